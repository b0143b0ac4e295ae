"""The data directory: one folder per conversation.

    <data>/conversations/<id>/meta.json         id, title, persona, model identity, params, summary (atomic writes)
    <data>/conversations/<id>/transcript.jsonl  append-only events, fsynced: the source of truth
    <data>/conversations/<id>/state.kv          append-only KV records (see core/kv/records.py): a cache
    <data>/conversations/<id>/lock              locked (fsutil.try_lock) by the process that has it open

This is the only module that knows these paths. Each file carries its format version; the rule for
reading them (newer: refused; older: upgraded; unknown additions: skipped) is in migrations.py.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sqlite3
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from chatcli.core.files import migrations
from chatcli.core.files.fsutil import (
    append_durably,
    atomic_write_text,
    ensure_private_dir,
    fsync_dir,
    read_at,
    try_lock,
    unlock,
    write_at,
)
from chatcli.core.files.index import Index, IndexUnavailable
from chatcli.core.files.migrations import META_VERSION, TRANSCRIPT_VERSION, FormatError
from chatcli.core.kv import records
from chatcli.errors import ChatcliError, Kind

_ID_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"  # no 0/o, 1/l/i: ids get read aloud and typed
_ID_RE = re.compile(r"\A[a-z0-9]{1,32}\Z")  # \Z: "$" would also match before a final newline


class StoreError(ChatcliError, ValueError):
    """A conversation id or folder is unusable; the message is one line for the user."""

    kind: Kind = "not_found"


class LockedError(StoreError):
    """Another live process has the conversation open."""

    kind: Kind = "conflict"


def new_id(n: int = 6) -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(n))


def now() -> float:
    return round(time.time(), 3)


@dataclass
class TranscriptRead:
    events: list[dict[str, Any]] = field(default_factory=list)
    dropped_lines: int = 0
    problems: list[str] = field(default_factory=list)


def _is_version(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


class ConversationDir:
    """Files of one conversation."""

    def __init__(self, path: Path, index: Index | None = None) -> None:
        self.path = path
        self.id = path.name
        self._lock_fd: int | None = None
        # Told after every durable write (transcript first, index after); None: nothing to tell.
        self.index = index

    def _tell(self, what: str, *args: Any) -> None:
        """Pass a write on to the index. Its failure never fails the write: the files are the truth, and
        the index re-reads a folder whose stamps disagree with its row."""
        if self.index is None:
            return
        try:
            getattr(self.index, what)(self, *args)
        except (sqlite3.Error, IndexUnavailable, OSError, ValueError, TypeError) as exc:
            # ValueError/TypeError: a hand-edited meta.json with odd field types; the row is re-read later.
            msg = f"index not updated ({exc}): it is re-read from the folders later"
            if msg not in self.index.notices:
                self.index.notices.append(msg)

    @cached_property  # each a Path made once (a first build reads every folder's)
    def meta_path(self) -> Path:
        return self.path / "meta.json"

    @cached_property
    def transcript_path(self) -> Path:
        return self.path / "transcript.jsonl"

    @cached_property
    def state_path(self) -> Path:
        return self.path / "state.kv"

    # -- metadata ------------------------------------------------------------------------------------

    def read_meta(self, *, check_state: bool = True) -> dict[str, Any]:
        """The metadata, upgraded to the current format.

        Also refuses (``FormatError``) a conversation whose state file is of a newer format, so that every
        path that opens a conversation stops here, before anything is written; the transcript's lines are
        checked as they are read. ``check_state=False``: the caller knows there is no state file (it just
        listed the folder).
        """
        try:
            meta = json.loads(self.meta_path.read_text("utf-8"))
        except FileNotFoundError:
            raise StoreError(f"conversation {self.id} has no metadata (folder {self.path})") from None
        except (ValueError, UnicodeDecodeError):
            raise StoreError(f"conversation {self.id}: metadata is corrupt ({self.meta_path})") from None
        if not isinstance(meta, dict):
            raise StoreError(f"conversation {self.id}: metadata is corrupt ({self.meta_path})")
        where = f"conversation {self.id}"
        try:
            migrations.check("metadata", meta.get("format"), META_VERSION, where=where)
        except FormatError:
            raise
        except ValueError:
            raise StoreError(f"{where}: unsupported metadata format {meta.get('format')!r}") from None
        if check_state:
            records.check_format(self.state_path)
        return migrations.upgrade_meta(meta)

    def write_meta(self, meta: dict[str, Any]) -> None:
        meta = {**meta, "format": META_VERSION}
        atomic_write_text(self.meta_path, json.dumps(meta, indent=2, sort_keys=True, ensure_ascii=False))
        self._tell("note_meta", meta)

    # -- summary: what `chatcli ls` shows without replaying the transcript ----------------------------

    def transcript_stamp(self) -> list[int]:
        """The transcript's size and mtime (ns): it only ever grows by appends, so an unchanged stamp means
        unchanged content. [0, 0] when there is none."""
        try:
            st = self.transcript_path.stat()
        except FileNotFoundError:
            return [0, 0]
        return [st.st_size, st.st_mtime_ns]

    @staticmethod
    def make_summary(exchanges: int, in_context: int, stamp: list[int]) -> dict[str, Any]:
        """The counts the writer derived from the transcript, tied to the transcript it derived them from."""
        return {"exchanges": exchanges, "in_context": in_context, "transcript": stamp}

    def cached_counts(self, meta: dict[str, Any], stamp: list[int] | None = None) -> tuple[int, int] | None:
        """(exchanges, in context) from the metadata's summary if the transcript is still the one it was
        computed from (``stamp``: its stamp, when the caller just took it); None otherwise (the caller
        replays the transcript, which is the truth)."""
        s = meta.get("summary")
        if not isinstance(s, dict) or s.get("transcript") != (self.transcript_stamp() if stamp is None else stamp):
            return None
        ex, ic = s.get("exchanges"), s.get("in_context")
        if type(ex) is not int or type(ic) is not int or not 0 <= ic <= ex:  # bool is not a count
            return None
        return ex, ic

    # -- transcript ------------------------------------------------------------------------------

    def append_event(self, event: dict[str, Any]) -> None:
        record = {"v": TRANSCRIPT_VERSION, "ts": now(), **event}
        data = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        append_durably(self.transcript_path, data)
        self._tell("note_append", data)

    def read_transcript(self) -> TranscriptRead:
        out = TranscriptRead()
        try:
            raw = self.transcript_path.read_bytes()
        except FileNotFoundError:
            return out
        lines = raw.split(b"\n")
        torn_tail = bool(lines and lines[-1])  # no final newline: the last append did not complete
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                event = json.loads(line.decode("utf-8"))
                if not isinstance(event, dict) or "type" not in event:
                    raise ValueError("not an event")
                # A line of a newer format refuses the whole transcript (FormatError): skipping it would
                # lose what it says, and continuing after it could contradict it.
                migrations.check("transcript", event.get("v"), TRANSCRIPT_VERSION,
                                 where=f"conversation {self.id} (line {i + 1})")
                event = migrations.upgrade_event(event)
            except FormatError:
                raise
            except (ValueError, UnicodeDecodeError):
                out.dropped_lines += 1
                where = "last line (torn write)" if torn_tail and i == len(lines) - 1 else f"line {i + 1}"
                out.problems.append(f"transcript {where} is unreadable and was skipped")
                continue
            out.events.append(event)
        return out

    def repair_transcript_tail(self) -> None:
        """Fix a torn last line so later appends start on a line of their own.

        A torn line is an append that did not complete: if what was written does not parse, it is cut
        (like a torn state record; `read_transcript` has already reported it), otherwise it is terminated.
        Leaving unparseable bytes would make every later open warn about them again.
        """
        try:
            with self.transcript_path.open("rb+") as fh:
                raw = fh.read()
                if not raw or raw.endswith(b"\n"):
                    return
                start = raw.rfind(b"\n") + 1
                try:
                    event = json.loads(raw[start:].decode("utf-8"))
                    # A whole event of any version is not torn (one of a newer version is not ours to cut).
                    torn = not (isinstance(event, dict) and "type" in event and _is_version(event.get("v")))
                except (ValueError, UnicodeDecodeError):
                    torn = True
                if torn:
                    fh.truncate(start)
                else:
                    fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())
        except FileNotFoundError:
            pass

    # -- locking ---------------------------------------------------------------------------------

    def lock(self) -> None:
        """Take the conversation's OS lock (dies with the process, so a killed holder never blocks)."""
        path = self.path / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            locked = try_lock(fd)
        except OSError:
            os.close(fd)
            raise
        if not locked:
            holder = ""
            try:
                holder = read_at(fd, 32, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            who = f"process {holder}" if holder else "another process"
            raise LockedError(f"conversation {self.id} is open in {who}")
        os.ftruncate(fd, 0)
        write_at(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        self._remove_stale_temp_files()
        self._tell("note_open")

    def _remove_stale_temp_files(self) -> None:
        # Only the lock holder writes here, so a temp file of an atomic write that exists now was left by a
        # process killed mid-write (a state snapshot can be megabytes): it will never be renamed into place.
        for tmp in self.path.glob(".*.tmp"):
            try:
                tmp.unlink()
            except OSError:
                pass

    def unlock(self) -> None:
        if self._lock_fd is not None:
            self._tell("note_close")
            try:
                unlock(self._lock_fd)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def state_size(self) -> int:
        try:
            return self.state_path.stat().st_size
        except FileNotFoundError:
            return 0

    def state_changed(self) -> None:
        """The state file was written (appended, rewritten, removed): the index updates its sizes."""
        self._tell("note_state")


class ConversationStore:
    """All conversations under one data dir."""

    def __init__(self, root: Path, *, indexed: bool = True) -> None:
        self.root = root
        self._indexed = indexed
        self._index: Index | None = None

    @property
    def index(self) -> Index | None:
        """The SQLite cache of these folders (``<data>/index.sqlite``), opened on first use; None when this
        store runs without one (or it cannot be opened: then everything reads the folders)."""
        if self._index is None and self._indexed:
            index = Index(self.root)
            try:
                index.db()
            except (sqlite3.Error, IndexUnavailable, OSError):
                self._indexed = False
                return None
            self._index = index
        return self._index

    def dir(self, cid: str) -> ConversationDir:
        return ConversationDir(self.root / cid, self.index)

    def _ensure_root(self) -> None:
        ensure_private_dir(self.root)

    def validate_id(self, ref: str) -> str:
        if not ref or "\x00" in ref or "/" in ref or "\\" in ref or ref in (".", "..") or not _ID_RE.match(ref):
            raise StoreError(f"invalid conversation id {ref!r}: ids are short lowercase letters and digits")
        return ref

    def create(self, meta: dict[str, Any]) -> ConversationDir:
        self._ensure_root()
        # A summary copied from another conversation (a fork's parent) describes another transcript.
        fresh = {k: v for k, v in meta.items() if k != "summary"}
        for _ in range(100):
            cid = new_id()
            path = self.root / cid

            def make(cid: str = cid, path: Path = path) -> ConversationDir | None:
                try:
                    path.mkdir(mode=0o700)
                except FileExistsError:
                    return None
                fsync_dir(self.root)
                conv = self.dir(cid)
                conv.write_meta({**fresh, "id": cid, "created": now(), "updated": now()})
                return conv

            # Through the index: it records the new folder itself, so the next `ls` need not walk the names.
            made = make() if self.index is None else self.index.own_change(cid, make, links=1)
            if made is not None:
                return made
        raise StoreError("could not allocate a conversation id")

    def ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _ID_RE.match(p.name))

    def resolve(self, ref: str | None) -> ConversationDir:
        """An id, a unique prefix of one, or (None) the most recently updated conversation."""
        if ref is None:
            return self._most_recent()
        self.validate_id(ref)
        if (self.root / ref).is_dir():  # a whole id: no listing of the other folders
            return self.dir(ref)
        try:
            with os.scandir(self.root) as it:
                matches = sorted(e.name for e in it if e.name.startswith(ref) and _ID_RE.match(e.name) and e.is_dir())
        except FileNotFoundError:
            matches = []
        if not matches:
            raise StoreError(f"no conversation {ref!r} (see `chatcli ls`)")
        if len(matches) > 1:
            raise StoreError(f"{ref!r} is ambiguous: {', '.join(matches[:8])}")
        return self.dir(matches[0])

    def _most_recent(self) -> ConversationDir:
        index = self.index
        if index is not None:
            try:
                index.reconcile()
                rows = index.rows(limit=1)
            except (sqlite3.Error, IndexUnavailable):
                rows = None
            if rows is not None:
                if not rows:
                    raise StoreError("no conversations yet: start one with `chatcli talk`")
                return self.dir(rows[0].id)
        convs = self.list()
        if not convs:
            raise StoreError("no conversations yet: start one with `chatcli talk`")
        return convs[0][0]

    def list(self, problems: list[str] | None = None) -> list[tuple[ConversationDir, dict[str, Any]]]:
        """Conversations whose metadata is readable; why the others are left out goes to ``problems``."""
        out = []
        for cid in self.ids():
            conv = self.dir(cid)
            try:
                meta = conv.read_meta()
            except (StoreError, FormatError) as exc:
                if problems is not None:
                    problems.append(str(exc))
                continue
            out.append((conv, meta))
        out.sort(key=lambda cm: cm[1].get("updated", 0), reverse=True)
        return out

    def remove(self, conv: ConversationDir) -> None:
        conv.lock()  # refuse to delete a conversation someone has open
        try:
            if self.index is None:
                shutil.rmtree(conv.path)
            else:  # the index forgets it and, where it can show nothing else changed, needs no walk for it
                self.index.own_change(conv.id, lambda: shutil.rmtree(conv.path), links=-1)
        finally:
            conv.unlock()
        fsync_dir(self.root)
