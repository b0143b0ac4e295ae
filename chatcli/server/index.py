"""The prefix index: which stored conversation shares the longest history with a request.

Every conversation on disk — the server's and the REPL's — is indexed by the chain keys of its message
boundaries (``history.chain``): after the persona, and after each message still in its context. A lookup
walks the request's keys from the longest down and returns the conversations holding that boundary, with
the token position it ends at, so the caller can restore exactly that much state and evaluate only the rest.

The index is a cache of what the transcripts say: it is saved in the data directory's SQLite index
(``core/files/index.py``, one row per conversation, only the changed ones written) so a restarted server
does not replay every transcript, and each entry remembers the size and mtime of the transcript it was
built from. Which conversations another process changed (a REPL turn, ``chatcli rm``) comes from the
SQLite index's change numbers, so a request looks at those only, not at every folder; at start the whole
data directory is reconciled once (one stat per folder). Without a usable SQLite index it falls back to
one JSON file and a stat of every transcript per request.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from chatcli.core.files.fsutil import atomic_write_text
from chatcli.core.files.index import Index, IndexUnavailable
from chatcli.core.files.migrations import FormatError
from chatcli.core.files.store import ConversationDir, ConversationStore, StoreError
from chatcli.core.template import Message
from chatcli.core.transcript import ActiveMessage, Replay, replay_events
from chatcli.core.views import shifted_out
from chatcli.server import history

if TYPE_CHECKING:  # the index is loaded without the conversation's engine-side modules
    from chatcli.core.conversation import Conversation

# 2: a reply's key is its answer (reasoning left out): keys of version 1 are recomputed
# 3: each conversation's owner (API clients are matched only with their own)
INDEX_VERSION = 3
RECONCILE_EVERY = 60.0  # seconds between two looks at every folder (~30 ms at 10,000 conversations)
REPL_OWNER = "repl"  # the owner of conversations not made through the API


def owner_of(meta: dict[str, Any]) -> str:
    """Whose a conversation is: an API client's namespace (``api:`` + its key's id, ``api:`` without a key),
    or the REPL's."""
    if meta.get("source") != "api":
        return REPL_OWNER
    return "api:" + str(meta.get("api_client", ""))


log = logging.getLogger("chatcli.server")


class Entry(NamedTuple):
    """One boundary of one conversation: after ``k`` of its active messages, the state holds ``pos`` tokens.
    A named tuple: a server start makes three per conversation, and a frozen dataclass's ``__init__`` was
    a third of loading 10,000 conversations' rows."""

    conv: str
    k: int
    pos: int
    rest: int  # messages the conversation has after the boundary (0: its end, continuing needs no fork)
    updated: float
    owner: str = ""

    @property
    def end(self) -> bool:
        return self.rest == 0


@dataclass
class PersonaInfo:
    messages: tuple[Message, ...]
    name: str
    hash: str


@dataclass
class _Conv:
    size: int
    mtime: int
    root: str
    persona: PersonaInfo | None
    updated: float
    entries: list[tuple[str, int, int]]  # (key, k, pos)
    n_active: int
    owner: str = ""  # see owner_of


@dataclass(frozen=True)
class Shape:
    """What the index keys a conversation by, from its files (``of_replay``) or open (``of``)."""

    has_prefix: bool
    persona: tuple[Message, ...]
    n_prefix: int  # tokens of the persona prefix
    dropped: list[Message]  # messages a context shift dropped, as a client resends them
    active: list[ActiveMessage]

    @classmethod
    def of_replay(cls, r: Replay) -> Shape:
        return cls(r.has_prefix, tuple(r.persona_messages), len(r.prefix_tokens), shifted_out(r), list(r.active))

    @classmethod
    def of(cls, conv: Conversation) -> Shape:
        # An open conversation has its prefix record: opening writes one or refuses.
        return cls(True, tuple(conv.persona_messages), conv.n_prefix_tokens, conv.out_of_context, conv.messages)


def conversation_keys(root: str, conv: Conversation | Shape) -> list[tuple[str, int, int]]:
    """(key, k, pos) for each boundary whose state the conversation holds.

    Messages that a context shift dropped are part of the history a client resends, so they enter the
    chain; but only boundaries after them can be restored. Replies count by their answer
    (``history.message_key`` strips reasoning too; a reply stored without a closed reasoning block has an
    answer the text alone would not show).
    """
    sh = conv if isinstance(conv, Shape) else Shape.of(conv)
    keys = history.chain(root, [*sh.dropped, *(Message(m.role, m.shown) for m in sh.active)])
    out: list[tuple[str, int, int]] = []
    if not sh.dropped:
        out.append((root, 0, sh.n_prefix))
    for k, m in enumerate(sh.active, start=1):
        out.append((keys[len(sh.dropped) + k - 1], k, m.p1))
    return out


def _is_id(store: ConversationStore, name: str) -> bool:
    """The store's own rule for a conversation folder's name (``ConversationStore.ids``)."""
    try:
        store.validate_id(name)
    except StoreError:
        return False
    return True


class PrefixIndex:
    def __init__(
        self,
        store: ConversationStore,
        path: Path,
        *,
        model_identity: dict[str, Any],
        n_ctx: int,
        template_source: str,
    ) -> None:
        self.store = store
        self.path = path
        self.identity = model_identity
        self.n_ctx = n_ctx
        self.template_source = template_source
        # The file whose size and mtime say "changed" (a name the store owns).
        self._transcript = store.dir("x").transcript_path.name
        self._stamp = hashlib.sha256(json.dumps(
            {"id": model_identity, "n_ctx": n_ctx, "t": template_source}, sort_keys=True).encode()).hexdigest()[:16]
        self._convs: dict[str, _Conv] = {}
        self._keys: dict[str, list[Entry]] = {}
        # What a request asks of every conversation, kept as they come and go so that asking costs the number
        # of personas, not of conversations: persona → owner → conversations with boundaries; root → owner →
        # conversation ids (in the order they came).
        self._persona_owners: dict[tuple[Message, ...], dict[str, int]] = {}
        self._root_convs: dict[str, dict[str, dict[str, None]]] = {}
        self._dirty = False
        self._changed: set[str] = set()  # conversations whose row is not saved yet
        self._saved_at = 0.0
        self._seq: int | None = None  # the SQLite index's change number this index has caught up with
        self._reconciled_at = -RECONCILE_EVERY
        self._load()

    # -- keys ----------------------------------------------------------------------------------------

    def root(self, persona: Iterable[Message]) -> str:
        return history.root_key(self.identity, self.n_ctx, self.template_source, tuple(persona))

    def personas(self, owners: frozenset[str] | None = None) -> list[tuple[Message, ...]]:
        """Personas of the indexed conversations (to recognise a REPL persona a client resends whole);
        of those ``owners`` have, when given."""
        return [p for p, by in self._persona_owners.items() if owners is None or any(o in owners for o in by)]

    def persona_for_root(self, root: str, owners: frozenset[str] | None = None) -> PersonaInfo | None:
        for owner, cids in self._root_convs.get(root, {}).items():
            if owners is None or owner in owners:
                for cid in cids:
                    return self._convs[cid].persona
        return None

    # -- lookup --------------------------------------------------------------------------------------

    def lookup(self, root: str, keys: list[str], *, only: str | None = None,
               owners: frozenset[str] | None = None) -> tuple[int, list[Entry]]:
        """The longest matched boundary: (messages matched after the persona, entries); (-1, []) if none.
        ``owners``: only conversations of these owners (a client never meets another's)."""
        for i in range(len(keys), -1, -1):
            key = keys[i - 1] if i else root
            found = [e for e in self._keys.get(key, ())
                     if (only is None or e.conv == only) and (owners is None or e.owner in owners)]
            if found:
                return i, found
        return -1, []

    # -- maintenance -----------------------------------------------------------------------------------

    def refresh(self, *, save: bool = True, full: bool = False) -> None:
        """Re-read conversations whose transcript changed since they were indexed; forget deleted ones.

        Runs before every request. With the SQLite index only the conversations changed since the last
        call are looked at (a query, then a stat each): chatcli processes tell the index of every write.
        The whole directory (one stat per folder: changes made behind chatcli's back) is reconciled at the
        first call, when ``full``, and at most every ``RECONCILE_EVERY`` seconds otherwise.
        ``save=False`` leaves saving the index to after the reply.
        """
        shared = self.store.index
        if shared is None:
            self._refresh_all()
        else:
            try:
                if full or time.monotonic() - self._reconciled_at >= RECONCILE_EVERY:
                    shared.reconcile(full=full)  # otherwise its stamps say whether the folders need a walk
                    self._reconciled_at = time.monotonic()
                self._refresh_changed(shared)
            except (sqlite3.Error, IndexUnavailable):
                self._refresh_all()
        if save:
            self.save_soon()

    def _refresh_changed(self, shared: Index) -> None:
        if self._seq is None:
            seq, _ = shared.changed_since(-1)
            stamps = shared.stamps()
            for cid in list(self._convs):
                if cid not in stamps:
                    self._drop(cid)
            candidates = list(stamps)
        else:
            seq, candidates = shared.changed_since(self._seq)
        for cid in candidates:
            self._check(cid, f"{self.store.root}{os.sep}{cid}{os.sep}{self._transcript}")
        self._seq = seq

    def _check(self, cid: str, transcript: str) -> None:
        try:
            st = os.stat(transcript)
        except OSError:
            if cid in self._convs:
                self._drop(cid)
            return
        old = self._convs.get(cid)
        if old is not None and old.size == st.st_size and old.mtime == st.st_mtime_ns:
            # Changed all the same (the index says so): its metadata, which names its owner. Who may match
            # it follows at once (a conversation shared with, or taken from, the API).
            try:
                owner = owner_of(self.store.dir(cid).read_meta())
            except (StoreError, FormatError, OSError):
                return
            if owner == old.owner:
                return
        self._index_dir(self.store.dir(cid), st.st_size, st.st_mtime_ns)

    def _refresh_all(self) -> None:
        ids: dict[str, str] = {}  # id → its transcript's path
        try:
            with os.scandir(self.store.root) as it:
                for ent in it:  # the store's own rule for a conversation folder (ConversationStore.ids)
                    if _is_id(self.store, ent.name) and ent.is_dir():
                        ids[ent.name] = f"{ent.path}{os.sep}{self._transcript}"
        except (FileNotFoundError, NotADirectoryError):
            pass  # no conversations yet
        for cid in list(self._convs):
            if cid not in ids:
                self._drop(cid)
        for cid, transcript in ids.items():
            self._check(cid, transcript)

    def update(self, conv: Conversation) -> None:
        """Re-index a conversation this process just wrote (no need to read the transcript back)."""
        try:
            st = self.store.dir(conv.id).transcript_path.stat()
        except OSError:
            return
        self._set(conv.id, st.st_size, st.st_mtime_ns, Shape.of(conv), conv.meta)

    def _index_dir(self, conv_dir: ConversationDir, size: int, mtime: int) -> None:
        try:
            meta = conv_dir.read_meta()
            r = replay_events(conv_dir.read_transcript().events)
            self._set(conv_dir.id, size, mtime, Shape.of_replay(r), meta)
        except (StoreError, FormatError, OSError, ValueError, TypeError, AttributeError) as exc:
            # One unusable folder (a newer chatcli's, wrongly typed metadata, an unreadable transcript) is
            # left out, as `chatcli ls` leaves it out, and said once: it is remembered with no boundaries,
            # so it is read again only when its transcript changes.
            log.warning("conversation %s skipped: %s", conv_dir.id, str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__)
            self._drop(conv_dir.id)
            self._convs[conv_dir.id] = _Conv(size, mtime, "", None, 0.0, [], 0)
            self._dirty = True

    def _set(self, cid: str, size: int, mtime: int, sh: Shape, meta: dict[str, Any]) -> None:
        self._drop(cid)
        model = {k: v for k, v in dict(meta.get("model") or {}).items() if k != "path"}
        n_ctx = int(dict(meta.get("params") or {}).get("n_ctx", 0) or 0)
        updated = float(meta.get("updated", 0) or 0)
        usable = sh.has_prefix and model == self.identity and n_ctx == self.n_ctx
        persona = sh.persona
        root = self.root(persona) if usable else ""
        entries = conversation_keys(root, sh) if usable else []
        info = PersonaInfo(persona, str(meta.get("persona", "")), str(meta.get("persona_hash", ""))) if usable else None
        self._convs[cid] = _Conv(size, mtime, root, info, updated, entries, len(sh.active), owner_of(meta))
        self._add(cid)
        self._dirty = True
        self._changed.add(cid)

    def _add(self, cid: str) -> None:
        c = self._convs[cid]
        if c.persona is not None:
            if c.entries:
                by = self._persona_owners.setdefault(c.persona.messages, {})
                by[c.owner] = by.get(c.owner, 0) + 1
            self._root_convs.setdefault(c.root, {}).setdefault(c.owner, {})[cid] = None
        for key, k, pos in c.entries:
            self._keys.setdefault(key, []).append(Entry(cid, k, pos, c.n_active - k, c.updated, c.owner))

    def _drop(self, cid: str) -> None:
        c = self._convs.pop(cid, None)
        if c is None:
            return
        if c.persona is not None:
            by = self._persona_owners.get(c.persona.messages, {})
            if c.entries and c.owner in by:
                by[c.owner] -= 1
                if by[c.owner] <= 0:
                    del by[c.owner]
                if not by:
                    self._persona_owners.pop(c.persona.messages, None)
            roots = self._root_convs.get(c.root, {})
            roots.get(c.owner, {}).pop(cid, None)
            if not roots.get(c.owner, True):
                del roots[c.owner]
            if not roots:
                self._root_convs.pop(c.root, None)
        for key, _k, _pos in c.entries:
            lst = [e for e in self._keys.get(key, ()) if e.conv != cid]
            if lst:
                self._keys[key] = lst
            else:
                self._keys.pop(key, None)
        self._dirty = True
        self._changed.add(cid)

    # -- persistence -----------------------------------------------------------------------------------

    def _remove_stale_temp_files(self, age: float = 60.0) -> None:
        """Temp files of saves cut short by a kill: never renamed into place, so removed (only old ones:
        a younger one may be another server's save in progress)."""
        try:
            for tmp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
                if time.time() - tmp.stat().st_mtime > age:
                    tmp.unlink()
        except OSError:
            pass

    def _load(self) -> None:
        # Tens of thousands of small objects, none of them cyclic: the cyclic collector, run again and again
        # as they accumulate, took a third of loading 10,000 conversations' rows.
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._load_rows()
        finally:
            if enabled:
                gc.enable()

    def _load_rows(self) -> None:
        self._remove_stale_temp_files()
        shared = self.store.index
        try:
            if shared is not None:
                # The change number the saved rows are caught up with (saved with them): the first refresh
                # then looks only at what changed since, not at every conversation (a stat and a meta.json
                # read each: seconds at 10,000 before `serve` could answer).
                saved = dict(shared.extra(self._extra_name + "-seq"))
                rows: Iterable[tuple[str, Any]] = ((cid, json.loads(v)) for cid, v in shared.extra(self._extra_name))
            else:
                doc = json.loads(self.path.read_text("utf-8"))
                if doc.get("version") != INDEX_VERSION or doc.get("stamp") != self._stamp:
                    return  # another model or format: rebuilt from the transcripts
                rows = doc["convs"].items()
            personas: dict[tuple[str, ...], PersonaInfo] = {}  # most conversations share a few personas: each made once
            for cid, c in rows:
                persona = None
                if c.get("persona") is not None:
                    p = c["persona"]
                    seen = (str(p["name"]), str(p["hash"]), *(f"{m[0]}\0{m[1]}" for m in p["messages"]))
                    persona = personas.get(seen)
                    if persona is None:
                        persona = personas[seen] = PersonaInfo(
                            tuple(Message(str(m[0]), str(m[1])) for m in p["messages"]), str(p["name"]), str(p["hash"]))
                self._convs[cid] = _Conv(int(c["size"]), int(c["mtime"]), str(c["root"]), persona,
                                         float(c["updated"]), [(str(k), int(a), int(b)) for k, a, b in c["entries"]],
                                         int(c["n_active"]), str(c["owner"]))
                self._add(cid)
            if shared is not None and "seq" in saved:
                self._seq = int(saved["seq"])
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, sqlite3.Error, IndexUnavailable):
            self._convs.clear()  # an unreadable index is only a cache: start over
            self._keys.clear()
            self._persona_owners.clear()
            self._root_convs.clear()
            self._seq = None

    @property
    def _extra_name(self) -> str:
        # Rows of another model, context size or template are kept apart (a server with another model
        # would index the same folders differently), under this index's format version.
        return f"server-prefix-{INDEX_VERSION}-{self._stamp}"

    def save_soon(self, interval: float = 10.0) -> None:
        """Save when changed, at most every ``interval`` seconds: a stale saved index costs a restarted
        server only the re-reading of the transcripts that changed since (their size/mtime tell)."""
        if self._dirty and time.monotonic() - self._saved_at >= interval:
            self.save()

    def _doc(self, c: _Conv) -> dict[str, Any]:
        persona = None
        if c.persona is not None:
            persona = {"messages": [[m.role, m.content] for m in c.persona.messages],
                       "name": c.persona.name, "hash": c.persona.hash}
        return {"size": c.size, "mtime": c.mtime, "root": c.root, "persona": persona,
                "updated": c.updated, "entries": c.entries, "n_active": c.n_active, "owner": c.owner}

    def save(self) -> None:
        shared = self.store.index
        try:
            if shared is not None:
                # Only the rows that changed: a save costs what changed, not the size of the store.
                rows: list[tuple[str, str | None]] = []
                for cid in self._changed:
                    c = self._convs.get(cid)
                    rows.append((cid, None if c is None else json.dumps(self._doc(c), ensure_ascii=False,
                                                                        separators=(",", ":"))))
                with shared.write():  # the rows and the change number they are caught up with, together
                    shared.put_extra(self._extra_name, rows)
                    if self._seq is not None:
                        shared.put_extra(self._extra_name + "-seq", [("seq", str(self._seq))])
            else:
                convs = {cid: self._doc(c) for cid, c in self._convs.items()}
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                atomic_write_text(self.path, json.dumps({"version": INDEX_VERSION, "stamp": self._stamp,
                                                         "convs": convs}, ensure_ascii=False, separators=(",", ":")))
            self._dirty = False
            self._changed.clear()
            self._saved_at = time.monotonic()
        except (OSError, sqlite3.Error, IndexUnavailable):
            pass  # the index is rebuilt from the transcripts when it cannot be saved

    def __len__(self) -> int:
        return len(self._convs)


