"""The prefix index: which stored conversation shares the longest history with a request.

Every conversation on disk — the server's and the REPL's — is indexed by the chain keys of its message
boundaries (``history.chain``): after the persona, and after each message still in its context. A lookup
walks the request's keys from the longest down and returns the conversations holding that boundary, with
the token position it ends at, so the caller can restore exactly that much state and evaluate only the rest.

The index is a cache of what the transcripts say, kept in tables of the data directory's SQLite index
(``core/files/index.py`` ``PrefixRows``) with an index on the key: a request reads the rows of its own keys,
a start reads none, so neither costs more with more conversations. Each row remembers the size and mtime
of the transcript it was built from. Which conversations another process changed (a REPL turn, ``chatcli
rm``) comes from the SQLite index's change numbers, so a request looks at those only, not at every folder;
at start the data directory is reconciled once (its stamps say whether the folders need a walk). Without a
usable SQLite index the tables live in memory, saved to one JSON file, and every transcript is stat-ed per
request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from chatcli.core.files.fsutil import atomic_write_text
from chatcli.core.files.index import Index, IndexUnavailable, PrefixPut, PrefixRows
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
# 4: rows in tables of their own, looked up per request (core/files/index.py PrefixRows)
# 5: the persona stored once per row (its key made from it when a row is dropped)
INDEX_VERSION = 5
LOOKUP_LIMIT = 32  # entries a lookup returns per owner: the candidates a request tries, not every sharer
UPDATE_WAIT_S = 0.05  # the longest a reply's re-index waits for another process's write (then: retried later)
BUILD_NOTICE = 2000  # a refresh that checks this many conversations says so in the log (a first start)
BUILD_EVERY_S = 5.0  # ... and how far it got, this often
BUILD_CHUNK = 512  # conversations per transaction in such a build (``_chunks``)
RECONCILE_EVERY = 60.0  # seconds between two reconciles (stamps, and a slice of the folders: ~10 ms)
REPL_OWNER = "repl"  # the owner of conversations not made through the API


class BuildProgress:
    """How far a big refresh (a first start after many folders were copied in) has got: (done, total), or
    None when none is running. The server answers 503 ``Loading model`` until its first refresh is done;
    while one this big runs, the answer says how far it got (``app.UntilLoaded``). One per process: the
    service that builds is made on the loading thread, before the app can know its index."""

    def __init__(self) -> None:
        self._at: tuple[int, int] | None = None

    def set(self, at: tuple[int, int] | None) -> None:
        self._at = at  # one reference replaced: read whole by any thread

    def get(self) -> tuple[int, int] | None:
        return self._at


BUILDING = BuildProgress()


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
    """The prefix index of one server (its model, context size and template): its rows are tables of the
    SQLite index (``core/files/index.py`` ``PrefixRows``), read per request for the request's keys only, so
    starting costs the same at 10 conversations as at 100,000 (before, every conversation's rows were loaded
    into memory at start: linear, seconds at 100k). Without a usable SQLite index the same tables live in
    memory, loaded from and saved to one JSON file."""

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
        self._state = store.dir("x").state_path.name
        self._stamp = hashlib.sha256(json.dumps(
            {"id": model_identity, "n_ctx": n_ctx, "t": template_source}, sort_keys=True).encode()).hexdigest()[:16]
        self._dirty = False
        self._saved_at = 0.0
        self._seq: int | None = None  # the SQLite index's change number this index has caught up with
        self._reconciled_at = -RECONCILE_EVERY
        self._pending: set[str] = set()  # written here, not re-indexed yet (``update`` met a busy index)
        self._roots: dict[tuple[Message, ...], str] = {}
        self._docs: dict[tuple[tuple[Message, ...], str, str], tuple[str, str]] = {}
        self._rows = self._open()

    @property
    def rows_read(self) -> int:
        """Rows read back from the tables so far (what a start or a request costs, for tests)."""
        return self._rows.rows_read

    # -- keys ----------------------------------------------------------------------------------------

    def root(self, persona: Iterable[Message]) -> str:
        # Kept per persona: a first start computes it for every stored conversation, and most share a
        # handful of personas (a sha256 of the template and a JSON document each: 6 % of that start).
        key = tuple(persona)
        got = self._roots.get(key)
        if got is None:
            if len(self._roots) >= 1024:
                self._roots.clear()
            got = self._roots[key] = history.root_key(self.identity, self.n_ctx, self.template_source, key)
        return got

    def personas(self, owners: frozenset[str] | None = None) -> list[tuple[Message, ...]]:
        """Personas of the indexed conversations (to recognise a REPL persona a client resends whole);
        of those ``owners`` have, when given."""
        try:
            keys = self._rows.personas(owners)
        except sqlite3.Error:
            self._lost()
            return []
        return [tuple(Message(str(m[0]), str(m[1])) for m in json.loads(k)) for k in keys]

    def persona_for_root(self, root: str, owners: frozenset[str] | None = None) -> PersonaInfo | None:
        try:
            doc = self._rows.persona_for_root(root, owners)
        except sqlite3.Error:
            self._lost()
            return None
        if doc is None:
            return None
        p = json.loads(doc)
        return PersonaInfo(tuple(Message(str(m[0]), str(m[1])) for m in p["messages"]), str(p["name"]), str(p["hash"]))

    # -- lookup --------------------------------------------------------------------------------------

    def lookup(self, root: str, keys: list[str], *, only: str | None = None,
               owners: frozenset[str] | None = None) -> tuple[int, list[Entry]]:
        """The longest matched boundary: (messages matched after the persona, entries); (-1, []) if none.
        ``owners``: only conversations of these owners (a client never meets another's). At most
        ``LOOKUP_LIMIT`` entries per owner: the ones the server would try first (that had a state file,
        then going least beyond the boundary, then the most recent), however many conversations share it
        (copies, or a client's forks: thousands share a persona's root)."""
        try:
            for i in range(len(keys), -1, -1):
                key = keys[i - 1] if i else root
                found = [Entry(*r) for r in self._rows.lookup(key, owners=owners, only=only, limit=LOOKUP_LIMIT)]
                if found:
                    return i, found
        except sqlite3.Error:
            self._lost()
        return -1, []

    # -- maintenance -----------------------------------------------------------------------------------

    def refresh(self, *, save: bool = True, full: bool = False) -> None:
        """Re-read conversations whose transcript changed since they were indexed; forget deleted ones.

        Runs before every request. With the SQLite index only the conversations changed since the last
        call are looked at (a query, then a stat each): chatcli processes tell the index of every write.
        The whole directory (one stat per folder: changes made behind chatcli's back) is reconciled at the
        first call, when ``full``, and at most every ``RECONCILE_EVERY`` seconds otherwise.
        ``save=False`` leaves saving the change number (or the JSON file) to after the reply.
        """
        for attempt in (1, 2):
            try:
                self._refresh(full)
                break
            except sqlite3.Error:
                if attempt == 2:
                    break  # the index is only a cache: the next request tries again
                self._lost()
        if save:
            self.save_soon()

    def _refresh(self, full: bool) -> None:
        shared = self.store.index
        if shared is None:
            self._refresh_all()
            return
        try:
            if full or time.monotonic() - self._reconciled_at >= RECONCILE_EVERY:
                shared.reconcile(full=full)  # otherwise its stamps say whether the folders need a walk
                self._reconciled_at = time.monotonic()
            self._refresh_changed(shared)
        except IndexUnavailable:
            self._refresh_all()

    def _lost(self) -> None:
        """The tables failed (the shared index was rebuilt under this process, say): make them again and
        check every conversation at the next refresh."""
        self._seq = None
        try:
            self._rows.ensure()
        except (sqlite3.Error, IndexUnavailable):
            pass

    def _chunks(self, cids: list[str], size: int = 64) -> Iterator[list[str]]:
        # One transaction per chunk: fewer commits than one per conversation, and other processes' writes
        # wait at most one chunk's reading of transcripts (not a whole first build's). A big build uses
        # BUILD_CHUNK: each commit writes the pages its rows dirtied, and the keys' index is in hash order,
        # so a chunk dirties about a page per key: bigger chunks write each page fewer times.
        for i in range(0, len(cids), size):
            yield cids[i:i + size]

    def _refresh_changed(self, shared: Index) -> None:
        if self._seq is not None and self._seq < shared.removed_floor():
            self._seq = None  # removals since then were pruned from the index: check every conversation
        if self._seq is None:
            seq, _ = shared.changed_since(-1)
            stamps = shared.stamps()
            gone = [cid for cid in self._rows.ids() if cid not in stamps]
            for chunk in self._chunks(gone):
                with self._rows.write():
                    for cid in chunk:
                        self._drop(cid)
            candidates = list(stamps)
            self._dirty = self._dirty or bool(gone)
        else:
            seq, candidates = shared.changed_since(self._seq)
        listed = set(candidates)
        candidates = [*candidates, *(cid for cid in self._pending if cid not in listed)]
        # A first start after many folders were copied in reads every transcript (~0.6 ms each) before
        # /health answers: the log says what it is doing, and how far it got every BUILD_EVERY_S.
        started = time.monotonic()
        big = len(candidates) >= BUILD_NOTICE
        if big:
            log.info("indexing %d conversations for the server …", len(candidates))
        next_say = started + BUILD_EVERY_S
        root = f"{self.store.root}{os.sep}"
        with self._rows.bulk(big):
            size = BUILD_CHUNK if big else 64
            try:
                for n, chunk in enumerate(self._chunks(candidates, size)):
                    if big:
                        BUILDING.set((n * size, len(candidates)))
                        if time.monotonic() >= next_say:
                            log.info("indexing conversations for the server: %d/%d", n * size, len(candidates))
                            next_say += BUILD_EVERY_S
                    with self._rows.write():
                        self._check_many([(cid, f"{root}{cid}{os.sep}{self._transcript}") for cid in chunk])
            finally:
                if big:
                    BUILDING.set(None)
        if len(candidates) >= BUILD_NOTICE:
            log.info("indexed %d conversations for the server in %.1f s", len(candidates), time.monotonic() - started)
        # Worth saving only when something was looked at (nothing indexed yet: no number to keep).
        self._dirty = self._dirty or bool(candidates)
        self._seq = seq
        self._pending.difference_update(candidates)

    def _check_many(self, items: list[tuple[str, str]]) -> None:
        """Re-index those of these (conversation, transcript path) whose transcript is not the one their row
        was built from; forget those without one. The rows' stamps are read in one query and the new rows
        written together (``PrefixRows.put_many``): a first build at 10,000 ran seven statements each."""
        stamps = self._rows.stamps([cid for cid, _ in items])
        puts: list[PrefixPut] = []
        for cid, transcript in items:
            try:
                st = os.stat(transcript)
            except OSError:
                self._drop(cid)
                continue
            old = stamps.get(cid)
            if old is not None and old[0] == st.st_size and old[1] == st.st_mtime_ns:
                # Changed all the same (the index says so): its metadata, which names its owner. Who may
                # match it follows at once (a conversation shared with, or taken from, the API). Its state
                # file too (evicted or written back): the order a lookup gives its candidates in.
                try:
                    owner = owner_of(self.store.dir(cid).read_meta())
                except (StoreError, FormatError, OSError):
                    continue
                if owner == old[2]:
                    if self._warm(cid) != old[3]:
                        self._rows.set_warm(cid, not old[3])
                    continue
            # Its state file looked at once: whether it is warm, and whether its format must be checked
            # (``read_meta`` would otherwise open it, or fail to, a third file per folder of a first build).
            warm = self._warm(cid)
            puts.append(self._index_dir(self.store.dir(cid), st.st_size, st.st_mtime_ns, warm))
        if puts:
            self._rows.put_many(puts)
            self._dirty = True

    def _warm(self, cid: str) -> bool:
        # A stat of the path as a string: a ConversationDir and its Path joins cost more than the stat (a
        # first build asks this of every folder).
        try:
            return os.stat(f"{self.store.root}{os.sep}{cid}{os.sep}{self._state}").st_size > 0
        except OSError:
            return False

    def _refresh_all(self) -> None:
        ids: dict[str, str] = {}  # id → its transcript's path
        try:
            with os.scandir(self.store.root) as it:
                for ent in it:  # the store's own rule for a conversation folder (ConversationStore.ids)
                    if _is_id(self.store, ent.name) and ent.is_dir():
                        ids[ent.name] = f"{ent.path}{os.sep}{self._transcript}"
        except (FileNotFoundError, NotADirectoryError):
            pass  # no conversations yet
        with self._rows.write():
            for cid in self._rows.ids():
                if cid not in ids:
                    self._drop(cid)
        for chunk in self._chunks(list(ids)):
            with self._rows.write():
                self._check_many([(cid, ids[cid]) for cid in chunk])

    def update(self, conv: Conversation) -> None:
        """Re-index a conversation this process just wrote (no need to read the transcript back)."""
        try:
            st = self.store.dir(conv.id).transcript_path.stat()
        except OSError:
            return
        try:
            # Not blocking: the service calls this under its lock, and another process holding the index's
            # write lock (a REPL's turn, a long rebuild) would hold up every request up to the busy timeout.
            with self._rows.write(timeout=UPDATE_WAIT_S):
                self._set(conv.id, st.st_size, st.st_mtime_ns, Shape.of(conv), conv.meta)
            self._pending.discard(conv.id)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                self._lost()
                return
            self._pending.add(conv.id)  # read back from its transcript at the next refresh
        except sqlite3.Error:
            self._lost()  # read back from its transcript at the next refresh

    def _index_dir(self, conv_dir: ConversationDir, size: int, mtime: int, warm: bool) -> PrefixPut:
        """The conversation's row, read from its files (``warm``: it has a state file)."""
        try:
            meta = conv_dir.read_meta(check_state=warm)
            r = replay_events(conv_dir.read_transcript().events)
            return self._put_args(conv_dir.id, size, mtime, Shape.of_replay(r), meta, warm)
        except (StoreError, FormatError, OSError, ValueError, TypeError, AttributeError) as exc:
            # One unusable folder (a newer chatcli's, wrongly typed metadata, an unreadable transcript) is
            # left out, as `chatcli ls` leaves it out, and said once: it is remembered with no boundaries,
            # so it is read again only when its transcript changes.
            log.warning("conversation %s skipped: %s", conv_dir.id, str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__)
            return (conv_dir.id, size, mtime, "", None, None, 0.0, 0, "", False, [])

    def _set(self, cid: str, size: int, mtime: int, sh: Shape, meta: dict[str, Any]) -> None:
        self._rows.put(*self._put_args(cid, size, mtime, sh, meta))
        self._dirty = True

    def _put_args(self, cid: str, size: int, mtime: int, sh: Shape, meta: dict[str, Any],
                  warm: bool | None = None) -> PrefixPut:
        """What ``PrefixRows.put`` stores for the conversation: its stamp, persona, owner and boundaries."""
        model = {k: v for k, v in dict(meta.get("model") or {}).items() if k != "path"}
        n_ctx = int(dict(meta.get("params") or {}).get("n_ctx", 0) or 0)
        updated = float(meta.get("updated", 0) or 0)
        usable = sh.has_prefix and model == self.identity and n_ctx == self.n_ctx
        persona = sh.persona
        root = self.root(persona) if usable else ""
        entries = conversation_keys(root, sh) if usable else []
        doc = persona_key = None
        if usable:  # the persona's two JSON documents, made once per persona (as its root key)
            name, phash = str(meta.get("persona", "")), str(meta.get("persona_hash", ""))
            docs = self._docs.get((persona, name, phash))
            if docs is None:
                if len(self._docs) >= 1024:
                    self._docs.clear()
                messages = [[m.role, m.content] for m in persona]
                docs = self._docs[(persona, name, phash)] = (
                    json.dumps({"messages": messages, "name": name, "hash": phash}, ensure_ascii=False),
                    json.dumps(messages, ensure_ascii=False))
            doc, persona_key = docs[0], (docs[1] if entries else None)
        return (cid, size, mtime, root, doc, persona_key, updated, len(sh.active), owner_of(meta),
                self._warm(cid) if warm is None else warm,
                entries)

    def _drop(self, cid: str) -> None:
        if self._rows.drop(cid):
            self._dirty = True

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

    def _open(self) -> PrefixRows:
        self._remove_stale_temp_files()
        shared = self.store.index
        if shared is not None:
            try:
                rows = shared.prefix_rows(self._name)
                # The change number the rows are caught up with: the first refresh then looks only at what
                # changed since, not at every conversation (a stat and a meta.json read each).
                saved = dict(shared.extra(self._name + "-seq"))
                if "seq" in saved:
                    self._seq = int(saved["seq"])
                # An older chatcli's rows (format 3: one JSON document per conversation in ``extra``) are
                # left alone: a server of that version may be running on the same data directory.
                return rows
            except (sqlite3.Error, IndexUnavailable, ValueError):
                self._seq = None  # the JSON file below, and every conversation checked
        rows = PrefixRows.in_memory(self._name)
        try:
            doc = json.loads(self.path.read_text("utf-8"))
            if doc.get("version") == INDEX_VERSION and doc.get("stamp") == self._stamp:
                with rows.write():
                    for cid, c in doc["convs"].items():
                        p = c.get("persona")
                        key = (json.dumps(p["messages"], ensure_ascii=False) if p is not None and c["entries"]
                               else None)
                        rows.put(str(cid), int(c["size"]), int(c["mtime"]), str(c["root"]),
                                 None if p is None else json.dumps(p, ensure_ascii=False), key, float(c["updated"]),
                                 int(c["n_active"]), str(c["owner"]), bool(c.get("warm", False)),
                                 [(str(k), int(a), int(b)) for k, a, b in c["entries"]])
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, sqlite3.Error):
            rows = PrefixRows.in_memory(self._name)  # an unreadable file is only a cache: start over
        return rows

    @property
    def _name(self) -> str:
        # Rows of another model, context size or template are kept apart (a server with another model
        # would index the same folders differently), under this index's format version.
        return f"server-prefix-{INDEX_VERSION}-{self._stamp}"

    def save_soon(self, interval: float = 10.0) -> None:
        """Save when changed, at most every ``interval`` seconds: the rows are written as they change; what
        waits is the change number they are caught up with (a stale one costs a restarted server only a
        check of the conversations changed since) or, without the SQLite index, the JSON file."""
        if self._dirty and time.monotonic() - self._saved_at >= interval:
            self.save()

    def save(self) -> None:
        shared = self.store.index
        try:
            if shared is not None and self._seq is not None:
                shared.put_extra(self._name + "-seq", [("seq", str(self._seq))])
            elif shared is None:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                atomic_write_text(self.path, json.dumps({"version": INDEX_VERSION, "stamp": self._stamp,
                                                         "convs": self._rows.dump()},
                                                        ensure_ascii=False, separators=(",", ":")))
            self._dirty = False
            self._saved_at = time.monotonic()
        except (OSError, sqlite3.Error, IndexUnavailable):
            pass  # the index is rebuilt from the transcripts when it cannot be saved

    def __len__(self) -> int:
        try:
            return self._rows.count()
        except sqlite3.Error:
            return 0
