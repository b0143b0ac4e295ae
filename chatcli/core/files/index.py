"""The index: an SQLite cache of the conversation folders (``<data>/index.sqlite``).

What it holds: one row per conversation with what ``chatcli ls`` shows, the state files' inodes and sizes
(the budget's running total, each inode once), every message's text for full-text search (FTS5; reasoning
in a column of its own, searched only when asked), and rows other indexes keep here (the server's prefix
index). The folders and transcripts stay the truth: everything here can be rebuilt from them.

How it stays true:
- every chatcli process writes through ``ConversationDir``, which tells the index after the file is
  durable (transcript first, index after: a message is searchable as soon as its line is written);
- ``reconcile`` compares folders' mtimes (a meta.json rewrite, a state rewrite or eviction, a copied
  or removed folder all change it) with the rows and re-reads what changed: the names when the
  conversations folder's own mtime moved, and ``SLICE_FOLDERS`` folders a call in rotation, so that
  every folder is checked within ceil(n / SLICE_FOLDERS) calls at a bounded cost each (the rows ``ls``
  shows are checked at once: ``check_rows``);
  a conversation open in a process that died (its ``open_pid`` is gone: a crash, a SIGKILL between a
  transcript line and its index row) is re-read too; the transcript's indexed bytes are checked by their
  crc32, so a hand edit anywhere in it re-indexes the whole conversation;
- a missing, truncated, corrupt or newer-version index file is rebuilt (``notices`` says so in one line);
  a locked one (another process holding a long write beyond the busy timeout) is skipped for that write,
  and the row is re-read later because its stamps disagree.

Several processes use it at once: WAL mode (readers never block the writer), a busy timeout, and every
update is one ``BEGIN IMMEDIATE`` transaction that re-checks the row's stamps before extending them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from chatcli.errors import ChatcliError
from chatcli.units import counted

if TYPE_CHECKING:
    from chatcli.core.files.store import ConversationDir

SCHEMA_VERSION = 2  # 2: meta_mtime (a hand-edited meta.json is seen)
FILE_NAME = "index.sqlite"
BUSY_TIMEOUT_S = 5.0
WALK_EVERY_S = 600.0  # the longest an unchanged conversations folder goes without its names walked (_reconcile)
# Folders whose own mtime each reconcile compares with the index's, in rotation (see ``_reconcile``): a
# stat each, ~10 ms of a command at any size; every folder is checked within ceil(n / SLICE_FOLDERS) calls
# (one at 2,000 conversations, 5 at 10,000, 50 at 100,000).
SLICE_FOLDERS = 2000
CHECKED_ROWS = 100  # the rows `ls` shows that are checked against their files (a screenful and more)
# A folder mtime this close to a walk may hide a change made after it in the same clock tick (see
# ``racy_window_ns``): for file systems with whole-second stamps (FAT's are 2 s) ...
COARSE_RACY_NS = 2_000_000_000
# ... and for fine-grained ones, whose stamps come from the kernel's coarse clock (a tick: 10 ms at HZ=100).
FINE_RACY_NS = 50_000_000
# A ``fine_stamps`` sample counts when the stamp moved by less than this: below the shortest tick of a
# coarse clock (1 ms at HZ=1000), so a coarse stamp, which stays or jumps by ticks, never does.
_PROBE_MAX_NS = 900_000
_PROBE_BUDGET_NS = 100_000_000  # samples are taken for at most this long (then: not shown fine)
_T = TypeVar("_T")
_ID_RE = re.compile(r"^[a-z0-9]{1,32}$")  # the store's rule for a conversation folder (store._ID_RE)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS info(key TEXT PRIMARY KEY, value);
CREATE TABLE IF NOT EXISTS convs(
    id TEXT PRIMARY KEY,
    dir_mtime INTEGER NOT NULL,       -- the folder's mtime (ns) when this row was read from it
    ok INTEGER NOT NULL,              -- 0: the folder is unusable (problem says why)
    problem TEXT NOT NULL DEFAULT '',
    title TEXT NOT NULL DEFAULT '', persona TEXT NOT NULL DEFAULT '', model TEXT NOT NULL DEFAULT '',
    source TEXT NOT NULL DEFAULT '', server TEXT NOT NULL DEFAULT '', kv_type TEXT NOT NULL DEFAULT 'f16',
    tokens INTEGER NOT NULL DEFAULT 0, updated REAL NOT NULL DEFAULT 0, created REAL NOT NULL DEFAULT 0,
    checkpoint_bytes INTEGER NOT NULL DEFAULT 0,
    turns INTEGER NOT NULL DEFAULT 0, in_context INTEGER NOT NULL DEFAULT 0,
    counts_size INTEGER NOT NULL DEFAULT -1, counts_mtime INTEGER NOT NULL DEFAULT -1,  -- transcript they count
    tx_size INTEGER NOT NULL DEFAULT 0, tx_mtime INTEGER NOT NULL DEFAULT 0,  -- transcript as indexed
    tx_crc INTEGER NOT NULL DEFAULT 0,     -- crc32 of the transcript's first tx_size bytes
    meta_mtime INTEGER NOT NULL DEFAULT 0, -- meta.json's mtime when last read (edited in place: re-read)
    state_bytes INTEGER NOT NULL DEFAULT 0,
    open_pid INTEGER,                      -- the process that has it open (a dead one: re-read it)
    seq INTEGER NOT NULL DEFAULT 0         -- bumped by every change: others follow changes by it
);
CREATE INDEX IF NOT EXISTS convs_updated ON convs(updated DESC);
CREATE INDEX IF NOT EXISTS convs_seq ON convs(seq);
CREATE INDEX IF NOT EXISTS convs_open ON convs(open_pid) WHERE open_pid IS NOT NULL;
CREATE TABLE IF NOT EXISTS files(conv TEXT NOT NULL, dev INTEGER NOT NULL, ino INTEGER NOT NULL,
    size INTEGER NOT NULL, PRIMARY KEY(conv, dev, ino)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS inodes(dev INTEGER NOT NULL, ino INTEGER NOT NULL, size INTEGER NOT NULL,
    refs INTEGER NOT NULL, PRIMARY KEY(dev, ino)) WITHOUT ROWID;
CREATE VIRTUAL TABLE IF NOT EXISTS hits USING fts5(
    text, reasoning, conv UNINDEXED, mid UNINDEXED, role UNINDEXED, ts UNINDEXED,
    tokenize = 'unicode61 remove_diacritics 2');
CREATE TABLE IF NOT EXISTS removed(conv TEXT PRIMARY KEY, seq INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS extra(name TEXT NOT NULL, conv TEXT NOT NULL, value TEXT NOT NULL,
    PRIMARY KEY(name, conv)) WITHOUT ROWID;
"""

# Added to schema 2 without a version bump (a chatcli of the same schema without them still reads and writes
# the file, and its writes keep the counts true: the triggers live in the file). An index that lacks them
# gets them at open (``_ensure_counts``).
_WARM_NEW = "(NEW.ok = 1 AND (CASE WHEN NEW.server != '' THEN NEW.checkpoint_bytes ELSE NEW.state_bytes END) > 0)"
_WARM_OLD = _WARM_NEW.replace("NEW.", "OLD.")
_COUNTS = f"""
CREATE INDEX IF NOT EXISTS convs_bad ON convs(id) WHERE ok = 0;
CREATE INDEX IF NOT EXISTS convs_list ON convs(updated DESC, id) WHERE ok = 1;
CREATE INDEX IF NOT EXISTS removed_seq ON removed(seq);
CREATE TRIGGER IF NOT EXISTS convs_n_ins AFTER INSERT ON convs BEGIN
    UPDATE info SET value = value + (NEW.ok = 1) WHERE key = 'n_ok';
    UPDATE info SET value = value + {_WARM_NEW} WHERE key = 'n_warm';
END;
CREATE TRIGGER IF NOT EXISTS convs_n_del AFTER DELETE ON convs BEGIN
    UPDATE info SET value = value - (OLD.ok = 1) WHERE key = 'n_ok';
    UPDATE info SET value = value - {_WARM_OLD} WHERE key = 'n_warm';
END;
CREATE TRIGGER IF NOT EXISTS convs_n_upd AFTER UPDATE OF ok, server, checkpoint_bytes, state_bytes ON convs
WHEN (NEW.ok = 1) != (OLD.ok = 1) OR {_WARM_NEW} != {_WARM_OLD} BEGIN
    UPDATE info SET value = value + (NEW.ok = 1) - (OLD.ok = 1) WHERE key = 'n_ok';
    UPDATE info SET value = value + {_WARM_NEW} - {_WARM_OLD} WHERE key = 'n_warm';
END;
INSERT OR REPLACE INTO info SELECT 'n_ok', COUNT(*) FROM convs WHERE ok = 1;
INSERT OR REPLACE INTO info SELECT 'n_warm', COUNT(*) FROM convs WHERE {_WARM_NEW.replace("NEW.", "")};
"""
# Reading this many folders at once (a first build, a catch-up with copied-in folders) checkpoints the WAL
# every BULK_CHECKPOINT_PAGES pages instead of SQLite's 1,000: each checkpoint fsyncs twice, 0.8 s of a
# 20,000-folder catch-up. The commits stay as durable as any (synchronous=NORMAL). The WAL grows to ~100 MB
# meanwhile and is cut back to JOURNAL_LIMIT when it restarts.
BULK_FOLDERS = 1000
REFRESH_CHUNK = 500  # folders read per transaction by a walk: other processes' writes wait at most ~0.1 s
BULK_CHECKPOINT_PAGES = 25_000
JOURNAL_LIMIT = 8 << 20
KEEP_REMOVED = 10_000  # rows of the ``removed`` table kept for followers of the change numbers (``_prune``)


class Walk(NamedTuple):
    """What one ``reconcile`` walk did: ``names`` (one scandir) or ``full`` (a stat per folder)."""

    kind: str
    folders: int  # conversation folders seen
    reread: int  # of which read into their rows (new, changed, or left open by a dead process)
    gone: int  # rows forgotten: their folder vanished
    seconds: float


class IndexUnavailable(ChatcliError):
    """The index could not be used for this operation (locked past the busy timeout)."""

    kind = "io"


class Row(NamedTuple):
    """One conversation as the index knows it (what ``ls`` shows). A named tuple: ``ls --all`` makes
    10,000 of them, three times faster than a frozen dataclass's ``__init__``."""

    id: str
    title: str
    persona: str
    model: str
    source: str
    server: str
    kv_type: str
    tokens: int
    updated: float
    turns: int
    in_context: int
    state_bytes: int

    def as_listing(self) -> dict[str, Any]:
        """The row in ``chatcli ls --json``'s shape."""
        out: dict[str, Any] = {
            "id": self.id, "title": self.title, "persona": self.persona, "turns": self.turns,
            "in_context": self.in_context, "tokens": self.tokens, "state_bytes": self.state_bytes,
            "updated": self.updated, "warm": self.state_bytes > 0, "kv_type": self.kv_type,
            "from": "api" if self.source == "api" else "",
        }
        if self.server:
            out["server"] = self.server
        return out


_ROW_COLS = ("id, title, persona, model, source, server, kv_type, tokens, updated, turns, in_context, "
             "CASE WHEN server != '' THEN checkpoint_bytes ELSE state_bytes END")


@dataclass(frozen=True)
class Hit:
    """One message that matched a search."""

    conv: str
    mid: int
    role: str
    ts: float
    snippet: str  # the matched words between HIGHLIGHT markers
    in_reasoning: bool
    title: str
    persona: str
    model: str
    source: str


HIGHLIGHT = ("\x02", "\x03")  # around matched words in a snippet: front ends turn them into bold or «»


@dataclass(frozen=True)
class SearchFilters:
    persona: str | None = None
    model: str | None = None  # a substring of the model's name
    since: float | None = None  # message time, seconds since the epoch
    until: float | None = None
    api: bool | None = None  # True: only API conversations; False: only the others
    reasoning: bool = False  # also search reasoning text


def fts_query(text: str) -> str:
    """The user's words as an FTS5 query: every word must occur (as a prefix for the last one), quotes
    doubled, so no input is FTS5 syntax (``AND``, ``*``, ``:`` …) and none is an error."""
    words = re.findall(r"\w+", text, re.UNICODE)
    if not words:
        return ""
    parts = ['"' + w.replace('"', '""') + '"' for w in words]
    parts[-1] += "*"
    return " ".join(parts)


def _message_fields(ev: dict[str, Any]) -> tuple[str, str] | None:
    """(message text, reasoning text) of a transcript event, None for events that hold no message.

    A reply with reasoning carries ``reasoning`` and ``answer`` fields (``{"text", "tokens"}``, see
    ``core.transcript.message_parts``): its ``text`` is the reply as generated, both together, so the answer
    is the message text. Without those fields all of the text is message text."""
    if ev.get("type") != "message":
        return None
    r, a = ev.get("reasoning"), ev.get("answer")
    if isinstance(r, dict) and isinstance(a, dict):
        return str(a.get("text", "")), str(r.get("text", ""))
    return str(ev.get("text", "")), ""


def racy_window_ns(mtime_ns: int) -> int:
    """How close to a walk's clock a folder mtime must be for a later change to be able to leave it as it is.

    A change stamps the folder with the file system's clock, truncated to its granularity. Once that clock
    has moved past the mtime a walk saw, any change after the walk stamps a later one, so an equal mtime
    means unchanged. The granularity shows in the stamp itself: a whole-second stamp (no digits below the
    second) is a coarse file system's, and there the clock may sit on one value for up to 2 s; otherwise
    the trailing zeros bound it (100 ns on NTFS, 10 ms on exFAT), and the kernel's coarse clock, which
    stamps files, lags the clock ``time.time_ns`` reads by at most a tick. One sample is enough: a coarse
    stamp is never mistaken for a fine one (its digits are zero), and a fine one that happens to end in
    zeros only widens the window."""
    sub = mtime_ns % 1_000_000_000
    if sub == 0:
        return COARSE_RACY_NS
    grain = 1
    while sub % (grain * 10) == 0:
        grain *= 10
    return max(FINE_RACY_NS, 2 * grain)


def _mtime(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _probe_fine_stamps(where: Path, root: Path) -> bool:
    """``Index.fine_stamps``, measured in a temporary folder in ``where`` (on ``root``'s file system)."""
    import tempfile

    try:
        if os.stat(where).st_dev != os.stat(root).st_dev:
            return False
        probe = tempfile.mkdtemp(prefix=".stamps-", dir=where)
    except OSError:
        return False
    sub = os.path.join(probe, "x")
    try:
        good = 0
        until = time.perf_counter_ns() + _PROBE_BUDGET_NS
        while time.perf_counter_ns() < until:
            # Primed first: the first change after a stat may take the coarse clock's time (it moves the
            # stamp anyway); the floor it leaves makes the next ones fine.
            os.stat(probe)
            os.mkdir(sub)
            os.stat(probe)
            t0 = time.perf_counter_ns()
            os.rmdir(sub)
            last = os.stat(probe).st_mtime_ns
            os.mkdir(sub)
            now = os.stat(probe).st_mtime_ns
            t1 = time.perf_counter_ns()
            os.rmdir(sub)
            if now == last:
                return False  # a change after a stat left the stamp as it was: coarse
            # Fine: the stamp moved by less than any coarse clock's tick (and, as any clock would, by no
            # more than the time the two changes took).
            if 0 < now - last < _PROBE_MAX_NS and now - last <= t1 - t0:
                good += 1
                if good == 2:
                    return True
        return False
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(sub)
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_META_COLS = ("title", "persona", "model", "source", "server", "kv_type", "tokens", "updated", "created",
              "checkpoint_bytes")  # the row's fields read from meta.json (``_meta_cols``)
_META_DEFAULTS: tuple[Any, ...] = ("", "", "", "", "", "f16", 0, 0.0, 0.0, 0)
_UPSERT_COLS = ("id", "dir_mtime", "ok", "problem", *_META_COLS, "turns", "in_context", "counts_size",
                "counts_mtime", "tx_size", "tx_mtime", "tx_crc", "meta_mtime", "state_bytes", "seq")
# Every column a folder's read sets (``_refresh_many``); ``open_pid`` is the holder's to set and clear.
_UPSERT = (f"INSERT INTO convs({', '.join(_UPSERT_COLS)}) VALUES({', '.join('?' * len(_UPSERT_COLS))}) "
           f"ON CONFLICT(id) DO UPDATE SET {', '.join(f'{c}=excluded.{c}' for c in _UPSERT_COLS[1:])}")


@contextmanager
def bulk_writes(db: sqlite3.Connection, on: bool = True) -> Iterator[None]:
    """Many writes to come (a first build, a catch-up): checkpoint the WAL every ``BULK_CHECKPOINT_PAGES``
    meanwhile, instead of SQLite's 1,000 pages (two fsyncs each). The commits stay as durable as any."""
    if not on:
        yield
        return
    db.execute(f"PRAGMA wal_autocheckpoint={BULK_CHECKPOINT_PAGES}")
    try:
        yield
    finally:
        db.execute("PRAGMA wal_autocheckpoint=1000")


def _meta_cols(meta: dict[str, Any]) -> tuple[Any, ...]:
    """The ``_META_COLS`` values of a conversation's metadata (ValueError/TypeError: a field of an odd type)."""
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    assert isinstance(model, dict)
    params = meta.get("params") if isinstance(meta.get("params"), dict) else {}
    assert isinstance(params, dict)
    ck = meta.get("checkpoint")
    ck_bytes = int(ck.get("bytes", 0) or 0) if isinstance(ck, dict) and isinstance(ck.get("bytes"), int) else 0

    def num(v: object) -> float:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0

    return (str(meta.get("title", "") or ""), str(meta.get("persona", "") or ""),
            str(model.get("name", "") or model.get("model", "") or ""),
            "api" if meta.get("source") == "api" else "", str(model.get("server", "") or ""),
            str(params.get("type_k", "f16")), int(num(meta.get("tokens"))), num(meta.get("updated")),
            num(meta.get("created")), ck_bytes)


def _hit_row(cid: str, line: bytes) -> tuple[Any, ...] | None:
    """A transcript line's row of the ``hits`` table; None for a line that holds no message."""
    if not line.strip():
        return None
    try:
        ev = json.loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None  # the store reports unreadable lines when the conversation is read
    if not isinstance(ev, dict):
        return None
    fields = _message_fields(ev)
    if fields is None:
        return None
    try:
        mid = int(ev.get("mid", -1))
        ts = float(ev.get("ts", 0) or 0)
    except (TypeError, ValueError):
        return None
    return (fields[0], fields[1], cid, mid, str(ev.get("role", "")), ts)


class Index:
    """The SQLite cache of one conversations folder. Core code: it never prints; ``notices`` collects the
    one-line reports (index rebuilt, repaired) for a front end to show."""

    def __init__(self, conversations_dir: Path, path: Path | None = None) -> None:
        self.root = conversations_dir
        self.path = path if path is not None else conversations_dir.parent / FILE_NAME
        self.notices: list[str] = []
        self._db: sqlite3.Connection | None = None
        self.rebuilt = False  # this process created the index afresh: reconcile reads every folder
        self.last_walk: Walk | None = None  # what the last ``reconcile`` walked (None: no walk was needed)
        self.last_slice: tuple[int, int] = (0, 0)  # its slice: (folders stat-ed, of which changed or gone)
        self._lock = threading.RLock()
        self._fine: bool | None = None  # ``fine_stamps``, once measured

    # -- the connection ------------------------------------------------------------------------------

    def db(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = self._open()
        return self._db

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        existed = self.path.exists() and self.path.stat().st_size > 0
        try:
            db = self._connect()
            version = self._check(db)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise IndexUnavailable(f"index {self.path} is locked by another process") from None
            return self._rebuild(f"unreadable ({exc})")
        except sqlite3.DatabaseError as exc:
            return self._rebuild(f"damaged ({exc})")
        if version is None:
            # No schema row yet: a new index, or another process creating it right now (its file already has
            # SQLite's header). Deleting it then would orphan that process's connection, and every write it
            # makes after would be lost, so it is completed instead: the creation script is idempotent.
            self.rebuilt = not existed
            try:
                self._init(db)
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    raise IndexUnavailable(f"index {self.path} is locked by another process") from None
                db.close()
                return self._rebuild(f"incomplete ({exc})")
            except sqlite3.DatabaseError as exc:
                db.close()
                return self._rebuild(f"incomplete ({exc})")
        elif version > SCHEMA_VERSION:
            db.close()
            return self._rebuild(f"from a newer chatcli (schema {version}, this one reads {SCHEMA_VERSION})")
        elif version < SCHEMA_VERSION:
            db.close()
            return self._rebuild(f"from an older chatcli (schema {version})")
        else:
            try:
                self._ensure_counts(db)
            except sqlite3.OperationalError:
                # Locked past the busy timeout, or a read-only data directory: the counts are counted
                # (``count``'s fallback) until an open that can write adds them.
                if db.in_transaction:
                    db.execute("ROLLBACK")
        return db

    @staticmethod
    def _ensure_counts(db: sqlite3.Connection) -> None:
        """The kept counts (``count``) and the index of unusable rows, added to an index made without them:
        the counts taken once, in the transaction that adds the triggers keeping them."""
        if db.execute("SELECT COUNT(*) FROM sqlite_master WHERE name IN ('convs_n_upd', 'convs_list')").fetchone()[0] == 2:
            return
        db.executescript("BEGIN IMMEDIATE;" + _COUNTS + "COMMIT;")

    def _connect(self) -> sqlite3.Connection:
        # Created private before SQLite opens it: it holds message text, and SQLite gives its -wal and -shm
        # files the database file's mode (sqlite3 alone would create it 0644 under the usual umask).
        # Only a file that does not exist yet is opened here: closing any descriptor of a database file
        # drops every POSIX lock this process holds on it, those of its other connections too (SQLite's
        # documented pitfall). A connection that lost its lock lets another process's closing connection
        # think it is the last one, checkpoint and delete the WAL under it: its later commits were lost
        # (the three-writer test, one run in ten under load). An existing file is only chmod-ed, by path.
        try:
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass
        except OSError:
            pass  # sqlite3 says what is wrong with the path, as an error the caller handles
        try:
            if self.path.stat().st_mode & 0o077:
                os.chmod(self.path, 0o600)
        except OSError:
            pass
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power loss may lose the last commits, never corrupt; the folders are the truth
        # and the stamps re-read whatever the index missed.
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA journal_size_limit={JOURNAL_LIMIT}")
        return db

    @staticmethod
    def _check(db: sqlite3.Connection) -> int | None:
        # No integrity check here (it reads the whole file: ~0.1 s per 50 MB, on every `ls`): damage found
        # later by any query rebuilds the index then (``_healing``).
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "info" not in names:
            return None
        row = db.execute("SELECT value FROM info WHERE key='schema'").fetchone()
        if row is None or not isinstance(row[0], int):
            return None
        version: int = row[0]
        if version == SCHEMA_VERSION and not {"convs", "files", "inodes", "hits", "extra", "removed"} <= names:
            return None
        return version

    def _healing(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; if the file turns out damaged (a corrupt page, a truncated file), rebuild and rerun."""
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise IndexUnavailable(f"index {self.path} is locked by another process") from None
            raise
        except sqlite3.DatabaseError as exc:
            if self._db is not None:
                self._db.close()
            self._db = self._rebuild(f"damaged ({exc})")
            self._reconcile(None)
            return fn()

    def _init(self, db: sqlite3.Connection) -> None:
        # One script, one transaction: two processes creating the index at once make it once.
        db.executescript("BEGIN IMMEDIATE;" + _SCHEMA + f"""
            INSERT OR IGNORE INTO info VALUES('schema', {SCHEMA_VERSION});
            INSERT OR IGNORE INTO info VALUES('state_total', 0);
            INSERT OR IGNORE INTO info VALUES('seq', 0);""" + _COUNTS + "COMMIT;")

    def _rebuild(self, why: str) -> sqlite3.Connection:
        """Start over: the index is only a cache of the folders, which ``reconcile`` reads back."""
        for suffix in ("", "-wal", "-shm", "-journal"):
            try:
                os.unlink(f"{self.path}{suffix}")
            except FileNotFoundError:
                pass
        self.notices.append(f"index {why}: rebuilt from the conversation folders")
        db = self._connect()
        self.rebuilt = True
        self._init(db)
        return db

    class _tx:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` (rolled back on any error): one writer at a time across processes,
        and across the threads of this one (the server's requests share the connection)."""

        def __init__(self, db: sqlite3.Connection, lock: threading.RLock, timeout: float | None = None) -> None:
            self.db = db
            self.lock = lock
            self.outer = False
            self.timeout = timeout

        def __enter__(self) -> sqlite3.Connection:
            self.lock.acquire()
            try:
                self.outer = not self.db.in_transaction
                if self.outer:
                    if self.timeout is None:
                        self.db.execute("BEGIN IMMEDIATE")
                    else:  # a write that would rather fail than wait long for another process's
                        self.db.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
                        try:
                            self.db.execute("BEGIN IMMEDIATE")
                        finally:
                            self.db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            except BaseException:
                self.lock.release()
                raise
            return self.db

        def __exit__(self, exc_type: object, *rest: object) -> None:
            try:
                if self.outer:
                    self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
            finally:
                self.lock.release()

    def write(self, timeout: float | None = None) -> _tx:
        """One write transaction; ``timeout``: wait at most that long for another process's write
        (``sqlite3.OperationalError`` "database is locked" past it) instead of ``BUSY_TIMEOUT_S``."""
        return Index._tx(self.db(), self._lock, timeout)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _next_seq(self, db: sqlite3.Connection, n: int = 1) -> int:
        """Take ``n`` change numbers; returns the last (they are the ``n`` up to it)."""
        db.execute("UPDATE info SET value = value + ? WHERE key='seq'", (n,))
        row = db.execute("SELECT value FROM info WHERE key='seq'").fetchone()
        return int(row[0])

    # -- keeping rows true -----------------------------------------------------------------------------

    def reconcile(self, progress: Callable[[int, int], None] | None = None, *, full: bool = False) -> int:
        """Re-read every folder the index disagrees with; returns how many were re-read (see ``_reconcile``)."""
        return int(self._healing(lambda: self._reconcile(progress, full=full)))

    def _reconcile(self, progress: Callable[[int, int], None] | None = None, *, full: bool = False) -> int:
        """Re-read the folders the index disagrees with; returns how many were re-read.

        Every call re-reads the conversations whose process died with them open (a query and a signal-0
        each), and checks a slice of the others (below). The conversations folder's names are walked only
        when a stamp says something may have changed behind the index, and only as much as it can tell:

        - the conversations folder's mtime is not the one recorded at the last walk: a folder was made,
          removed, renamed or copied in (by chatcli or by hand). Only names can have changed, so the walk
          is of names (one ``listdir``, no ``stat``: 0.1 s at 100,000 conversations, load 4): new folders are
          read, vanished ones forgotten;
        - the last walk of names is ``WALK_EVERY_S`` old: the one change the folder's mtime may not show
          (an outside one in the microseconds of ``own_change``'s window) is found by a walk of names too;
        - the index was just (re)built, or ``full`` (the server's ``refresh(full=True)``): every folder is
          ``stat``-ed (0.9 s at 100,000, load 6) and those whose mtime differs from the row's re-read.

        Changes *inside* a folder that no chatcli of this version told the index of (a hand edit saved by
        an editor, another version's write, a state file deleted by hand, a folder copied over another)
        move no stamp but that folder's own. They are found without a stat of every folder in one command
        (which made every 10th minute's `ls` cost 0.6-0.9 s at 100,000): the promise is that such a change
        is seen
        - at once in the rows a command shows: ``check_rows`` compares the first ``CHECKED_ROWS`` rows
          ``ls`` shows with their folder's mtime, transcript, meta.json and state files; a search hit is
          checked against its transcript (``search``);
        - anywhere else within ceil(n / ``SLICE_FOLDERS``) calls of this method (any process's: `ls`,
          `search`, `resume` without id, the server at start and once a minute): each call ``stat``-s the
          next ``SLICE_FOLDERS`` folders in id order after the cursor the last call left in the index
          (``slice_at``), wrapping around, and re-reads those whose mtime moved (or forgets those gone).
          A bounded cost per command (2,000 stats: ~10 ms) however many conversations there are.

        chatcli's own writes tell the index themselves and need no walk. A folder mtime within
        ``racy_window_ns`` of the walk is not trusted (a change in the same clock tick would not move it:
        git's "racily clean" entries), so the next call walks its names again: on a file system with fine
        stamps that is 50 ms, so an `ls` right after a change walks once and the next one does not.
        ``progress(done, total)`` is called while many folders are read. ``last_walk`` (and the index's
        ``walks_*`` counters, which other processes can read) says what walk the call made (a slice is
        not one: ``last_slice`` says what it checked): benchmarks and tests tell "ls, index current" from
        "ls after a walk" by it."""
        db = self.db()
        self.last_walk = None
        started = time.time_ns()
        t0 = time.perf_counter()
        try:
            root_mtime = os.stat(self.root).st_mtime_ns
        except OSError:
            root_mtime = -1
        kind = "full" if full or self.rebuilt else ""
        if not kind:
            got = dict(db.execute("SELECT key, value FROM info WHERE key IN ('root_mtime', 'walked_at')").fetchall())
            if (not isinstance(got.get("walked_at"), int) or started - got["walked_at"] >= WALK_EVERY_S * 1e9
                    or got["walked_at"] > started  # the clock went back: trust nothing
                    or got.get("root_mtime") != root_mtime):
                kind = "names"
        changed, vanished = ([], []) if kind == "full" else self._check_slice(db)
        if not kind:
            dead = [str(cid) for cid, pid in db.execute(
                "SELECT id, open_pid FROM convs WHERE open_pid IS NOT NULL").fetchall() if not _pid_alive(int(pid))]
            todo = list(dict.fromkeys(changed + dead))
            if vanished:
                with self.write() as w:
                    for cid in vanished:
                        self._forget(w, cid)
                    self._prune_removed(w)
            with bulk_writes(db, len(todo) >= BULK_FOLDERS):
                for start in range(0, len(todo), REFRESH_CHUNK):  # as a walk reads them
                    with self.write() as w:
                        self._refresh_many(w, todo[start:start + REFRESH_CHUNK])
            if changed or vanished:
                self._note_repair(len(changed), len(vanished))
            return len(todo) + len(vanished)
        seen: set[str] = set()
        n_seen = 0
        try:
            if kind == "full":
                known = dict(db.execute("SELECT id, dir_mtime FROM convs").fetchall())
                mtimes: dict[str, int] = {}
                with os.scandir(self.root) as it:
                    for ent in it:
                        if _ID_RE.match(ent.name):
                            try:
                                st = ent.stat()
                                if ent.is_dir():
                                    mtimes[ent.name] = st.st_mtime_ns
                            except OSError:
                                continue
                seen = set(mtimes)
                n_seen = len(seen)
                todo = [cid for cid, m in mtimes.items() if known.get(cid) != m]
                gone = [cid for cid in known if cid not in mtimes]
            else:
                # Sets, not a loop per entry in Python: names only (``listdir``, half of a ``scandir`` that
                # asks each entry its type), the known ids as one string (a row each took twice as long),
                # and only new names checked against the store's rule for an id and for being a folder.
                # A known id is kept while its name exists (a folder replaced by a file is left to the
                # slice, which looks at types).
                seen = set(os.listdir(self.root))
                joined = db.execute("SELECT group_concat(id, '/') FROM convs").fetchone()[0]
                ids = set(str(joined).split("/")) if joined else set()
                prefix = str(self.root) + os.sep
                todo = [cid for cid in seen - ids if _ID_RE.match(cid) and os.path.isdir(prefix + cid)]
                gone = list(ids - seen)
                n_seen = len(ids) - len(gone) + len(todo)
        except (FileNotFoundError, NotADirectoryError):
            todo = []
            gone = [str(r[0]) for r in db.execute("SELECT id FROM convs")]
        for cid, pid in db.execute("SELECT id, open_pid FROM convs WHERE open_pid IS NOT NULL").fetchall():
            if cid in seen and cid not in todo and not _pid_alive(int(pid)):
                todo.append(cid)  # its process died with the conversation open: lines may be unindexed
        if changed or vanished:  # the slice's: folders whose insides changed, or gone without a walk showing it
            gone = list(dict.fromkeys(gone + vanished))
            todo += [cid for cid in changed if cid not in set(todo) and cid not in gone]
        if gone:
            with self.write() as w:
                for cid in gone:
                    self._forget(w, cid)
                self._prune_removed(w)
        done = 0
        with bulk_writes(db, len(todo) >= BULK_FOLDERS):  # a first build or a catch-up
            step = REFRESH_CHUNK
            for start in range(0, len(todo), step):  # a transaction per chunk, not per folder
                with self.write() as w:
                    self._refresh_many(w, todo[start:start + step])
                done = min(start + step, len(todo))
                if progress is not None and len(todo) >= 200:
                    progress(done, len(todo))
        # The stamp this walk answers for: taken before it, so a change during the walk is seen next time.
        racy = root_mtime < 0 or root_mtime >= started - racy_window_ns(root_mtime)
        self.last_walk = Walk(kind, n_seen, len(todo), len(gone), time.perf_counter() - t0)
        with self.write() as w:
            w.execute("INSERT OR REPLACE INTO info VALUES('root_mtime', ?)", (-2 if racy else root_mtime,))
            # Any walk lists every name (the slice answers for the folders' insides).
            w.execute("INSERT OR REPLACE INTO info VALUES('walked_at', ?)", (started,))
            w.execute(f"INSERT INTO info VALUES('walks_{kind}', 1) ON CONFLICT(key) DO UPDATE SET value = value + 1")
            w.execute("INSERT OR REPLACE INTO info VALUES('last_walk', ?)", (json.dumps(self.last_walk._asdict()),))
        if self.rebuilt:
            if todo and not self.notices:  # made afresh while folders exist: it was deleted (or never made)
                self.notices.append(f"index missing: built from {counted(len(todo), 'conversation folder')}")
            self.rebuilt = False
        elif todo or gone:
            self._note_repair(len(todo), len(gone))
        return len(todo) + len(gone)

    def _check_slice(self, db: sqlite3.Connection) -> tuple[list[str], list[str]]:
        """The next ``SLICE_FOLDERS`` rows after the index's cursor (wrapping around), each folder's mtime
        compared with its row's: (ids whose folder changed, ids whose folder is gone or no longer a folder).
        The cursor moves on only if this process can write at once: otherwise the next call checks the same
        slice again (a busy index must not make `ls` wait for it)."""
        got = db.execute("SELECT value FROM info WHERE key='slice_at'").fetchone()
        after = str(got[0]) if got is not None and isinstance(got[0], str) else ""
        rows = db.execute("SELECT id, dir_mtime FROM convs WHERE id > ? ORDER BY id LIMIT ?",
                          (after, SLICE_FOLDERS)).fetchall()
        wrapped = len(rows) < SLICE_FOLDERS
        if wrapped:
            rows += db.execute("SELECT id, dir_mtime FROM convs WHERE id <= ? ORDER BY id LIMIT ?",
                               (after, SLICE_FOLDERS - len(rows))).fetchall()
        changed: list[str] = []
        vanished: list[str] = []
        prefix = str(self.root) + os.sep
        for cid, mtime in rows:
            try:
                st = os.stat(prefix + cid)
            except (FileNotFoundError, NotADirectoryError):
                vanished.append(str(cid))
                continue
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                vanished.append(str(cid))
            elif st.st_mtime_ns != mtime:
                changed.append(str(cid))
        self.last_slice = (len(rows), len(changed) + len(vanished))
        if rows:
            with contextlib.suppress(sqlite3.Error, IndexUnavailable), self.write(timeout=0) as w:
                w.execute("INSERT OR REPLACE INTO info VALUES('slice_at', ?)", (str(rows[-1][0]),))
                if wrapped:  # another full round of the folders: tests and benchmarks count them
                    w.execute("INSERT INTO info VALUES('slice_rounds', 1) "
                              "ON CONFLICT(key) DO UPDATE SET value = value + 1")
        return changed, vanished

    def walks(self) -> dict[str, int]:
        """How many walks of each kind (``names``, ``full``) any process made on this index so far."""
        return {str(k)[6:]: int(v) for k, v in self.db().execute(
            "SELECT key, value FROM info WHERE key IN ('walks_names', 'walks_full')")}

    def _note_repair(self, changed: int, gone: int) -> None:
        """Folders changed outside chatcli's own writes are normal (another version, a copy, a hand edit);
        only say something when many were re-read, so a routine `ls` after an edit stays quiet."""
        if changed + gone >= 200:
            self.notices.append(f"index: re-read {changed} changed and dropped {gone} removed conversation folder(s)")

    def refresh(self, cid: str) -> None:
        """Read one conversation's folder into its row (meta, counts, state files, transcript text)."""
        with self.write() as w:
            self._refresh_many(w, [cid])

    def _refresh_many(self, w: sqlite3.Connection, cids: list[str]) -> None:
        """Read these folders into their rows (meta, counts, state files, transcript text); forget those gone.

        The files are read per folder and the rows written per batch: one upsert of every column, one
        insert of all the messages (a first build of 90,000 copied-in folders ran 13 statements per folder,
        half of its 37 s). A row keeps what its folder cannot say now: its metadata fields when meta.json
        is unreadable (or has fields of odd types), its counts when the summary no longer describes the
        transcript (``counts_size`` -1: the shown rows are replayed, ``check_rows``)."""
        from chatcli.core.files.migrations import FormatError
        from chatcli.core.files.store import ConversationDir, StoreError

        cids = list(dict.fromkeys(cids))  # once each: a second read would index its messages twice
        if not cids:
            return
        marks = ",".join("?" * len(cids))
        known = {str(r[0]): r[1:] for r in w.execute(
            f"SELECT id, tx_size, tx_crc, open_pid, {', '.join(_META_COLS)}, turns, in_context FROM convs "
            f"WHERE id IN ({marks})", cids)}
        had_files = {str(r[0]) for r in w.execute(f"SELECT DISTINCT conv FROM files WHERE conv IN ({marks})", cids)}
        rows: list[list[Any]] = []
        hits: list[tuple[Any, ...]] = []
        reset: list[tuple[str]] = []
        files_of: list[tuple[str, list[tuple[int, int, int]]]] = []
        dead: list[tuple[str]] = []
        for cid in cids:
            conv = ConversationDir(self.root / cid)
            try:
                dir_mtime = os.stat(conv.path).st_mtime_ns
                names = os.listdir(conv.path)
            except OSError:
                self._forget(w, cid)
                continue
            problem = ""
            meta: dict[str, Any] = {}
            try:  # a state file's format is checked only where there is one (an open that fails costs too)
                meta = conv.read_meta(check_state="state.kv" in names)
            except (StoreError, FormatError) as exc:
                problem = str(exc)
            meta_mtime = _mtime(conv.meta_path)
            try:
                with open(conv.transcript_path, "rb") as fh:
                    raw = fh.read()
                    tx = os.fstat(fh.fileno())
                stamp = [tx.st_size, tx.st_mtime_ns]
            except OSError:
                raw, stamp = b"", [0, 0]
            old = known.get(cid)
            size0, crc0 = (int(old[0]), int(old[1])) if old is not None else (0, 0)
            # The lines past what is indexed; all of them if the indexed part changed (a hand edit).
            end = raw.rfind(b"\n") + 1  # a torn last line is left for when it is whole
            if size0 > end or zlib.crc32(raw[:size0]) != crc0:
                reset.append((cid,))
                size0 = 0
            crc = zlib.crc32(raw[size0:end], zlib.crc32(raw[:size0]) if size0 else 0)
            for line in raw[size0:end].split(b"\n"):
                hit = _hit_row(cid, line)
                if hit is not None:
                    hits.append(hit)
            meta_cols = tuple(old[3:3 + len(_META_COLS)]) if old is not None else _META_DEFAULTS
            if meta:
                try:
                    meta_cols = _meta_cols(meta)
                except (ValueError, TypeError):  # a hand edit gave a field an odd type: shown as it can be
                    pass
            # The counts come from the metadata's summary when it describes this transcript; otherwise they
            # stay unknown (counts_size -1) until a front end replays the transcript (``set_counts``):
            # replaying is the transcript module's job, a layer above this one.
            counts = conv.cached_counts(meta, stamp) if meta and not problem else None
            if counts is not None:
                turns, in_context, counts_stamp = counts[0], counts[1], stamp
            else:
                turns, in_context = (int(old[-2]), int(old[-1])) if old is not None else (0, 0)
                counts_stamp = [-1, -1]
            files = self._stat_files_in(conv.path, names)
            rows.append([cid, dir_mtime, 0 if problem else 1, problem, *meta_cols, turns, in_context, *counts_stamp,
                         end, stamp[1], crc, meta_mtime, sum(f[2] for f in files), 0])
            if files or cid in had_files:
                files_of.append((cid, files))
            if old is not None and old[2] is not None and not _pid_alive(int(old[2])):
                dead.append((cid,))  # read back now: a dead holder must not make every reconcile re-read it
        if not rows:
            return
        last = self._next_seq(w, len(rows))
        for i, row in enumerate(rows):
            row[-1] = last - len(rows) + 1 + i
        w.executemany("DELETE FROM hits WHERE conv=?", [r for r in reset if r[0] in known])
        w.executemany(_UPSERT, rows)
        w.executemany("INSERT INTO hits(text, reasoning, conv, mid, role, ts) VALUES(?, ?, ?, ?, ?, ?)", hits)
        self._add_files(w, [(cid, files) for cid, files in files_of if cid not in had_files])
        for cid, files in files_of:
            if cid in had_files:
                self._set_files(w, cid, files)
        w.executemany("UPDATE convs SET open_pid=NULL WHERE id=?", dead)

    def set_counts(self, cid: str, counts: tuple[int, int], stamp: list[int]) -> None:
        """Exchange counts a front end derived from the transcript whose (size, mtime) is ``stamp``."""
        with self.write() as w:
            w.execute("UPDATE convs SET turns=?, in_context=?, counts_size=?, counts_mtime=? WHERE id=?",
                      (counts[0], counts[1], stamp[0], stamp[1], cid))

    @staticmethod
    def _index_line(w: sqlite3.Connection, cid: str, line: bytes) -> None:
        hit = _hit_row(cid, line)
        if hit is not None:
            w.execute("INSERT INTO hits(text, reasoning, conv, mid, role, ts) VALUES(?, ?, ?, ?, ?, ?)", hit)

    @staticmethod
    def _set_meta(w: sqlite3.Connection, cid: str, meta: dict[str, Any]) -> None:
        w.execute(f"UPDATE convs SET {'=?, '.join(_META_COLS)}=? WHERE id=?", (*_meta_cols(meta), cid))

    # -- the state files' running total ----------------------------------------------------------------

    @staticmethod
    def _stat_files(conv: ConversationDir) -> list[tuple[int, int, int]]:
        return Index._stat_files_at(conv.path)

    @staticmethod
    def _stat_files_at(folder: Path) -> list[tuple[int, int, int]]:
        """(dev, ino, size) of the conversation's state file and the base files it links."""
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        return Index._stat_files_in(folder, names)

    @staticmethod
    def _stat_files_in(folder: Path, names: Iterable[str]) -> list[tuple[int, int, int]]:
        """``_stat_files_at`` when the folder's names are known (a listing already made)."""
        out: dict[tuple[int, int], int] = {}
        for n in names:
            if n == "state.kv" or (n.startswith("state.base-") and n.endswith(".kv")):
                try:
                    st = os.stat(folder / n)
                except OSError:
                    continue
                out[(st.st_dev, st.st_ino)] = st.st_size
        return [(d, i, s) for (d, i), s in out.items()]

    @staticmethod
    def _set_files(w: sqlite3.Connection, cid: str, files: Iterable[tuple[int, int, int]]) -> None:
        """Make the conversation's files these, keeping ``state_total`` = bytes of distinct inodes."""
        new = {(d, i): s for d, i, s in files}
        old = {(d, i): s for d, i, s in w.execute("SELECT dev, ino, size FROM files WHERE conv=?", (cid,))}
        delta = 0
        for key in old.keys() - new.keys():
            w.execute("DELETE FROM files WHERE conv=? AND dev=? AND ino=?", (cid, *key))
            refs, size = w.execute("SELECT refs, size FROM inodes WHERE dev=? AND ino=?", key).fetchone() or (1, 0)
            if refs <= 1:
                w.execute("DELETE FROM inodes WHERE dev=? AND ino=?", key)
                delta -= size
            else:
                w.execute("UPDATE inodes SET refs=refs-1 WHERE dev=? AND ino=?", key)
        for key, size in new.items():
            cur = w.execute("SELECT size FROM inodes WHERE dev=? AND ino=?", key).fetchone()
            if key not in old:
                w.execute("INSERT INTO files VALUES(?, ?, ?, ?)", (cid, *key, size))
                if cur is None:
                    w.execute("INSERT INTO inodes VALUES(?, ?, ?, 1)", (*key, size))
                    delta += size
                    continue
                w.execute("UPDATE inodes SET refs=refs+1 WHERE dev=? AND ino=?", key)
            elif old[key] != size:
                w.execute("UPDATE files SET size=? WHERE conv=? AND dev=? AND ino=?", (size, cid, *key))
            if cur is not None and cur[0] != size:
                w.execute("UPDATE inodes SET size=? WHERE dev=? AND ino=?", (size, *key))
                delta += size - cur[0]
        if delta:
            w.execute("UPDATE info SET value = value + ? WHERE key='state_total'", (delta,))
        w.execute("UPDATE convs SET state_bytes=? WHERE id=?", (sum(new.values()), cid))

    @staticmethod
    def _add_files(w: sqlite3.Connection, items: list[tuple[str, list[tuple[int, int, int]]]]) -> None:
        """``_set_files`` for conversations that had no files (new rows): the same rows and total, in a
        few statements for all of them (the warm tenth of a first build ran six each)."""
        if not items:
            return
        w.executemany("INSERT INTO files VALUES(?, ?, ?, ?)", [(cid, *f) for cid, files in items for f in files])
        added: dict[tuple[int, int], tuple[int, int]] = {}  # inode → (links added here, its size)
        for _, files in items:
            for d, i, size in files:
                added[(d, i)] = (added.get((d, i), (0, 0))[0] + 1, size)
        keys = list(added)
        before: dict[tuple[int, int], int] = {}
        for start in range(0, len(keys), 400):
            part = keys[start:start + 400]
            before.update({(int(d), int(i)): int(size) for d, i, size in w.execute(
                f"SELECT dev, ino, size FROM inodes WHERE (dev, ino) IN (VALUES {','.join(['(?, ?)'] * len(part))})",
                [x for key in part for x in key])})
        w.executemany("INSERT INTO inodes VALUES(?, ?, ?, ?) ON CONFLICT(dev, ino) DO UPDATE SET "
                      "refs = refs + excluded.refs, size = excluded.size",
                      [(*key, size, n) for key, (n, size) in added.items()])
        delta = sum(size - before.get(key, 0) for key, (_, size) in added.items())
        if delta:
            w.execute("UPDATE info SET value = value + ? WHERE key='state_total'", (delta,))

    def _forget(self, w: sqlite3.Connection, cid: str) -> None:
        self._set_files(w, cid, ())
        w.execute("DELETE FROM hits WHERE conv=?", (cid,))
        w.execute("DELETE FROM convs WHERE id=?", (cid,))
        w.execute("DELETE FROM extra WHERE conv=?", (cid,))
        w.execute("INSERT OR REPLACE INTO removed VALUES(?, ?)", (cid, self._next_seq(w)))

    def state_total(self) -> int:
        """Bytes of all conversations' state files (each inode once), as of the last writes."""
        row = self.db().execute("SELECT value FROM info WHERE key='state_total'").fetchone()
        return int(row[0]) if row else 0

    def set_all_files(self, items: Iterable[tuple[str, Iterable[tuple[int, int, int]]]]) -> None:
        """Replace every conversation's files with a full scan's (the budget's rescan repairs drift)."""
        with self.write() as w:
            w.execute("DELETE FROM files")
            w.execute("DELETE FROM inodes")
            w.execute("UPDATE info SET value=0 WHERE key='state_total'")
            w.execute("UPDATE convs SET state_bytes=0")
            for cid, files in items:
                if w.execute("SELECT 1 FROM convs WHERE id=?", (cid,)).fetchone():
                    self._set_files(w, cid, files)

    # -- hooks: ConversationDir calls these after its own durable writes --------------------------------

    def note_append(self, conv: ConversationDir, data: bytes) -> None:
        """``data`` (whole lines) was just appended to the transcript: index them, or re-read the folder if
        the row does not end where the append started (a line written by a process that died, say)."""
        try:
            st = conv.transcript_path.stat()
        except OSError:
            return
        before = st.st_size - len(data)
        with self.write() as w:
            row = w.execute("SELECT tx_size, tx_crc FROM convs WHERE id=?", (conv.id,)).fetchone()
            if row is not None and int(row[0]) == st.st_size:
                return  # another process's reconcile indexed it already
            if row is None or int(row[0]) != before:
                stale = True
            else:
                stale = False
                for line in data.split(b"\n"):
                    self._index_line(w, conv.id, line)
                # The folder's mtime too: the first line creates the file (a new entry in the folder). The
                # writer holds the conversation's lock, so no one else changed the folder meanwhile.
                w.execute("UPDATE convs SET tx_size=?, tx_mtime=?, tx_crc=?, seq=?, dir_mtime=? WHERE id=?",
                          (st.st_size, st.st_mtime_ns, zlib.crc32(data, int(row[1])), self._next_seq(w),
                           self._dir_mtime(conv), conv.id))
        if stale:
            self.refresh(conv.id)

    def note_meta(self, conv: ConversationDir, meta: dict[str, Any]) -> None:
        """meta.json was just rewritten: its fields, the counts of its summary, the state files' sizes."""
        try:
            dir_mtime = conv.path.stat().st_mtime_ns
        except OSError:
            return
        with self.write() as w:
            row = w.execute("SELECT tx_size FROM convs WHERE id=?", (conv.id,)).fetchone()
            if row is None:
                stale = True
            else:
                stale = False
                self._set_meta(w, conv.id, meta)
                s = meta.get("summary")
                if isinstance(s, dict) and isinstance(s.get("transcript"), list) and len(s["transcript"]) == 2:
                    w.execute("UPDATE convs SET turns=?, in_context=?, counts_size=?, counts_mtime=? WHERE id=?",
                              (int(s.get("exchanges", 0)), int(s.get("in_context", 0)),
                               int(s["transcript"][0]), int(s["transcript"][1]), conv.id))
                self._set_files(w, conv.id, self._stat_files(conv))
                w.execute("UPDATE convs SET dir_mtime=?, ok=1, problem='', seq=?, meta_mtime=? WHERE id=?",
                          (dir_mtime, self._next_seq(w), _mtime(conv.meta_path), conv.id))
        if stale:
            self.refresh(conv.id)

    def note_state(self, conv: ConversationDir) -> int:
        """The conversation's state files changed size: update them; returns the new running total."""
        with self.write() as w:
            if w.execute("SELECT 1 FROM convs WHERE id=?", (conv.id,)).fetchone():
                self._set_files(w, conv.id, self._stat_files(conv))
                # A new or rewritten (renamed) state file changes the folder: its writer holds the lock.
                w.execute("UPDATE convs SET dir_mtime=? WHERE id=?", (self._dir_mtime(conv), conv.id))
        return self.state_total()

    @staticmethod
    def _dir_mtime(conv: ConversationDir) -> int:
        try:
            return conv.path.stat().st_mtime_ns
        except OSError:
            return -1

    def note_open(self, conv: ConversationDir) -> None:
        """A process took the conversation's lock: make its row true now (it may be the one a crash left
        behind) and remember who has it, so a death before its next write is noticed by ``reconcile``."""
        row = self.db().execute("SELECT dir_mtime, tx_size, tx_crc FROM convs WHERE id=?", (conv.id,)).fetchone()
        try:
            dir_mtime = conv.path.stat().st_mtime_ns
            size = conv.transcript_path.stat().st_size
        except OSError:
            dir_mtime, size = -1, 0
        if row is None or int(row[0]) != dir_mtime or int(row[1]) != size:
            self.refresh(conv.id)
        with self.write() as w:  # the lock file may have just been made: the folder's mtime changed
            w.execute("UPDATE convs SET open_pid=?, dir_mtime=? WHERE id=?",
                      (os.getpid(), self._dir_mtime(conv), conv.id))

    def note_close(self, conv: ConversationDir) -> None:
        with self.write() as w:
            w.execute("UPDATE convs SET open_pid=NULL WHERE id=? AND open_pid=?", (conv.id, os.getpid()))

    def own_change(self, cid: str, change: Callable[[], _T], *, links: int) -> _T:
        """Run ``change``, chatcli's own creation (``links`` +1) or removal (-1) of folder ``cid``, so that the
        next ``reconcile`` need not walk the names it changed (0.2 s at 100,000 conversations).

        The conversations folder's mtime moves with the change, and a walk of its names would follow.
        Instead the folder's row is read here and the new mtime recorded as a walk's would be, but only when
        the index can show that nothing else changed the folder's names. All of it holds the index's write
        lock, so another chatcli's change waits its turn; an outside one (a copy by hand) cannot be held
        off, so it must show:
        - before: the mtime is the one the last walk (or own change) recorded: nothing changed it since;
        - during: the subfolder count (``st_nlink``, where the file system keeps one: not btrfs, nor ext4
          past 65,000 subfolders) moved by this change's folder alone;
        - after: the stamp is one that any later change moves, even in the same clock tick
          (``fine_stamps``). With the kernel's coarse stamps a copy right after the change would leave the
          mtime as it is: there nothing is recorded, and the next `ls` walks the names as before.
        The one change none of these shows is an outside one in the microseconds between this change and
        the ``stat`` after it that leaves the subfolder count as it was (a rename, or one folder added
        and one removed) on a file system that keeps no count: the periodic walk of names
        (``WALK_EVERY_S``) finds it.
        Whatever the index cannot do (locked, damaged), the change is still made: the next walk finds it."""
        try:
            tx = self.write()
            w = tx.__enter__()
        except (sqlite3.Error, IndexUnavailable):
            return change()
        made = False
        try:
            got = w.execute("SELECT value FROM info WHERE key='root_mtime'").fetchone()
            recorded = got[0] if got is not None else None
            before = self._root_stat()
            result = change()
            made = True
            after = self._root_stat()
            self._refresh_many(w, [cid])  # the new folder's row, or the removed one's forgotten
            if links < 0:
                self._prune_removed(w)
            if (before is not None and after is not None and recorded == before.st_mtime_ns
                    and after.st_mtime_ns != before.st_mtime_ns
                    and (before.st_nlink < 2 or after.st_nlink - before.st_nlink == links)
                    and self.fine_stamps()):
                w.execute("INSERT OR REPLACE INTO info VALUES('root_mtime', ?)", (after.st_mtime_ns,))
                w.execute("INSERT INTO info VALUES('own_changes', 1) ON CONFLICT(key) DO UPDATE SET value = value + 1")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                tx.__exit__(type(exc), exc, exc.__traceback__)  # rolled back: no stamp recorded
            if made and isinstance(exc, sqlite3.Error):
                return result  # the change was made; the index missed it, and the next walk reads it
            raise
        with contextlib.suppress(sqlite3.Error):
            tx.__exit__(None, None, None)  # not committed: the stamp is not recorded either
        return result

    def _root_stat(self) -> os.stat_result | None:
        try:
            return os.stat(self.root)
        except OSError:
            return None

    def fine_stamps(self) -> bool:
        """Whether a change to a folder after a ``stat`` of it always gets a new mtime, even within one tick
        of the kernel's clock: Linux's multigrain stamps (6.13 on: ext4, xfs, btrfs, tmpfs), or a clock as
        fine as the stamps. Measured once per process, in a folder made for it beside the index (on the
        conversations folder's file system): two changes with a ``stat`` between them must get stamps
        that differ by less than a tick of any coarse clock (``_PROBE_MAX_NS``), twice. Coarse stamps
        cannot pass: theirs stay equal (False at once) or jump by a whole tick (1 ms at least). On a disk
        so loaded that no two changes come that close within ``_PROBE_BUDGET_NS``, the answer is False:
        the next `ls` walks."""
        if self._fine is None:
            if not self.root.is_dir():
                return False  # nothing to measure yet: asked again once the folder exists
            # Once shown, kept in the index for this kernel and file system: a loaded disk may keep a later
            # process from showing it again (its samples too slow), and each process would pay ~0.1 ms.
            try:
                st = os.statvfs(self.root)
                key = f"{os.uname().release}/{os.stat(self.root).st_dev}/{st.f_fsid}"
            except (OSError, AttributeError):
                key = None
            db = self.db()
            got = db.execute("SELECT value FROM info WHERE key='fine_stamps'").fetchone()
            if key is not None and got is not None and got[0] == key:
                self._fine = True
            else:
                self._fine = _probe_fine_stamps(self.path.parent, self.root)
                if self._fine and key is not None:
                    with self.write() as w:
                        w.execute("INSERT OR REPLACE INTO info VALUES('fine_stamps', ?)", (key,))
        return self._fine

    def note_removed(self, cid: str) -> None:
        with self.write() as w:
            self._forget(w, cid)
            self._prune_removed(w)

    @staticmethod
    def _prune_removed(w: sqlite3.Connection, keep: int | None = None) -> None:
        """Keep the ``removed`` table to its last ``keep`` rows (it grew by one per conversation ever removed).
        Followers of the change numbers older than the rows dropped (``removed_floor``) cannot learn what
        was removed from it: they check every conversation instead, as on their first start."""
        row = w.execute("SELECT seq FROM removed ORDER BY seq DESC LIMIT 1 OFFSET ?",
                        (KEEP_REMOVED if keep is None else keep,)).fetchone()
        if row is None:
            return
        w.execute("DELETE FROM removed WHERE seq <= ?", (int(row[0]),))
        w.execute("INSERT INTO info VALUES('removed_floor', ?) ON CONFLICT(key) DO UPDATE SET "
                  "value = max(value, excluded.value)", (int(row[0]),))

    def removed_floor(self) -> int:
        """The last change number whose removals were pruned: ``changed_since`` older than it misses some."""
        row = self.db().execute("SELECT value FROM info WHERE key='removed_floor'").fetchone()
        return int(row[0]) if row is not None else -1

    # -- reading ---------------------------------------------------------------------------------------

    def count(self) -> tuple[int, int]:
        """(conversations, warm ones) among the usable rows: kept by triggers (counting them took 32 ms
        at 100,000 conversations, on every `ls`)."""
        got = dict(self.db().execute("SELECT key, value FROM info WHERE key IN ('n_ok', 'n_warm')").fetchall())
        if isinstance(got.get("n_ok"), int) and isinstance(got.get("n_warm"), int):
            return int(got["n_ok"]), int(got["n_warm"])
        row = self.db().execute("SELECT COUNT(*), COALESCE(SUM(CASE WHEN (CASE WHEN server != '' THEN "
                                "checkpoint_bytes ELSE state_bytes END) > 0 THEN 1 ELSE 0 END), 0) "
                                "FROM convs NOT INDEXED WHERE ok=1").fetchone()
        return int(row[0]), int(row[1])

    def problems(self) -> list[str]:
        # Through the partial index convs_bad: a scan of every row took 146 ms at 100,000 conversations.
        return [str(r[0]) for r in self.db().execute("SELECT problem FROM convs WHERE ok=0 ORDER BY id")]

    def rows(self, limit: int | None = None, ids: Iterable[str] | None = None) -> list[Row]:
        """Usable conversations, most recently updated first."""
        sql = f"SELECT {_ROW_COLS} FROM convs WHERE ok=1"
        args: list[Any] = []
        if ids is not None:
            id_list = list(ids)
            sql += f" AND id IN ({','.join('?' * len(id_list))})"
            args += id_list
        if limit is None:
            # Every row: read in table order and sorted here. Walking an index (SQLite picks convs_list,
            # whose condition is ``ok=1``) looks each row up in the table: 1.15 s at 100,000 conversations,
            # this way 0.36 s. NOT INDEXED makes it scan the table; a list of ids still uses the key.
            if ids is None:
                sql = sql.replace("FROM convs WHERE", "FROM convs NOT INDEXED WHERE")
            got = list(map(Row._make, self.db().execute(sql, args)))
            got.sort(key=itemgetter(0))
            got.sort(key=itemgetter(8), reverse=True)  # updated; stable: ties stay in id order
            return got
        sql += " ORDER BY updated DESC, id LIMIT ?"  # the first ``limit`` entries of convs_list: flat
        args.append(limit)
        return [Row(*r) for r in self.db().execute(sql, args)]

    def check_rows(self, rows: list[Row], counter: Callable[[str], tuple[tuple[int, int], list[int]] | None],
                   ) -> list[Row]:
        """The rows about to be shown, the first ``CHECKED_ROWS`` each checked against its files (a few stats)
        and re-read where they disagree: the folder's mtime moved (a file in it made, replaced or removed
        behind the index), a transcript grown or a state file written by another version, a meta.json
        edited in place, a crash mid-turn. The rows past those (``ls --all`` at 10,000: 40,000 stats would
        take longer than the listing) are shown as the index has them, repaired when ``reconcile``'s
        slice comes to them. ``counter(id)`` replays a transcript into (exchange counts, the stamp they
        describe) when the metadata's summary does not describe the transcript (None: unreadable, left out)."""
        changed = False
        db = self.db()
        cols = "id, tx_size, tx_mtime, counts_size, counts_mtime, state_bytes, server, meta_mtime, dir_mtime"
        checked = rows[:CHECKED_ROWS]
        known = {str(r[0]): r[1:] for r in db.execute(
            f"SELECT {cols} FROM convs WHERE id IN ({','.join('?' * len(checked))})", [r.id for r in checked])}
        if len(rows) > CHECKED_ROWS:
            # Unchecked rows: their counts only need to describe the transcript as indexed.
            shown = set(map(itemgetter(0), rows[CHECKED_ROWS:]))
            # A scan of the table (NOT INDEXED: through convs_list it looked every row up, 0.23 s at 100,000
            # conversations; 0.03 s this way).
            for (cid,) in db.execute("SELECT id FROM convs NOT INDEXED WHERE ok=1 AND (counts_size != tx_size "
                                     "OR counts_mtime != tx_mtime)").fetchall():
                if cid in shown:
                    changed = self._recount(str(cid), counter)
        root = str(self.root) + os.sep
        for r in checked:
            row = known.get(r.id)
            if row is None:
                continue
            folder = root + r.id
            try:
                tx = os.stat(folder + os.sep + "transcript.jsonl")
                stamp = (tx.st_size, tx.st_mtime_ns)
            except OSError:
                stamp = (0, 0)
            files = self._stat_files_at(Path(folder))
            # The folder's own mtime too: a change inside it that no chatcli recorded (a file replaced by
            # an editor's rename, a checkpoint deleted by hand, a folder copied over this one) is seen in
            # the rows shown at once, not only when the slice of ``_reconcile`` comes to it.
            if (stamp[0] != int(row[0]) or (not row[5] and sum(s for _, _, s in files) != int(row[4]))
                    or _mtime(Path(folder + os.sep + "meta.json")) != int(row[6])
                    or _mtime(Path(folder)) != int(row[7])):
                self.refresh(r.id)
                changed = True
                got = db.execute("SELECT tx_size, tx_mtime, counts_size, counts_mtime FROM convs WHERE id=?",
                                 (r.id,)).fetchone()
                if got is None:
                    continue
                row = tuple(got)
            if (int(row[2]), int(row[3])) != stamp:
                self._recount(r.id, counter)
                changed = True
        if not changed:
            return rows
        fresh = {r.id: r for r in self.rows(ids=[r.id for r in rows] if len(rows) <= 500 else None)}
        return [fresh[r.id] for r in rows if r.id in fresh]

    def _recount(self, cid: str, counter: Callable[[str], tuple[tuple[int, int], list[int]] | None]) -> bool:
        """Counts replayed from the transcript into the row, or the row marked unusable with the reason."""
        got = counter(cid)
        if got is None:
            from chatcli.core.files.store import ConversationDir

            problem = f"conversation {cid}: its transcript is unreadable"
            try:  # say why, as every other command does (a newer format, damage)
                ConversationDir(self.root / cid).read_transcript()
            except Exception as exc:
                problem = str(exc) or problem
            with self.write() as w:
                w.execute("UPDATE convs SET ok=0, problem=? WHERE id=?", (problem, cid))
        else:
            self.set_counts(cid, *got)
        return True

    def search(self, text: str, filters: SearchFilters = SearchFilters(), limit: int = 20) -> list[Hit]:
        """Messages matching every word of ``text`` (the last one as a prefix), best first (bm25)."""
        hits: list[Hit] = self._healing(lambda: self._search(text, filters, limit))
        if self._stale([h.conv for h in hits]):
            hits = self._healing(lambda: self._search(text, filters, limit))
        return hits

    def _stale(self, ids: Iterable[str]) -> bool:
        """Re-read those of these conversations whose transcript is not the one indexed (a hand edit the
        stamps did not show: a hit must be in the transcript as it is now). A stat each; True if any."""
        stale = []
        for cid in dict.fromkeys(ids):
            row = self.db().execute("SELECT tx_size, tx_mtime FROM convs WHERE id=?", (cid,)).fetchone()
            try:
                st = os.stat(self.root / cid / "transcript.jsonl")
                now = (st.st_size, st.st_mtime_ns)
            except OSError:
                now = (0, 0)
            # tx_size is where the last whole line ends: a torn tail (a line being written) is not a change.
            if row is None or now[1] != int(row[1]) or now[0] < int(row[0]):
                stale.append(cid)
        for cid in stale:
            self.refresh(cid)
        return bool(stale)

    def _search(self, text: str, filters: SearchFilters, limit: int) -> list[Hit]:
        q = fts_query(text)
        if not q:
            return []
        match = q if filters.reasoning else "text : (" + q + ")"
        sql = ["SELECT h.conv, h.mid, h.role, h.ts, snippet(hits, 0, ?, ?, '…', 12), "
               "snippet(hits, 1, ?, ?, '…', 12), c.title, c.persona, c.model, c.source, "
               "instr(highlight(hits, 0, ?, ''), ?) > 0 "
               "FROM hits h JOIN convs c ON c.id = h.conv WHERE hits MATCH ? AND c.ok=1"]
        args: list[Any] = [*HIGHLIGHT, *HIGHLIGHT, HIGHLIGHT[0], HIGHLIGHT[0], match]
        if filters.persona is not None:
            sql.append("AND c.persona = ?")
            args.append(filters.persona)
        if filters.model is not None:
            sql.append("AND instr(lower(c.model), lower(?)) > 0")
            args.append(filters.model)
        if filters.since is not None:
            sql.append("AND h.ts >= ?")
            args.append(filters.since)
        if filters.until is not None:
            sql.append("AND h.ts < ?")
            args.append(filters.until)
        if filters.api is not None:
            sql.append("AND c.source = 'api'" if filters.api else "AND c.source != 'api'")
        sql.append("ORDER BY rank LIMIT ?")
        args.append(limit)
        out = []
        for conv, mid, role, ts, snip_text, snip_reason, title, persona, model, source, in_text in \
                self.db().execute(" ".join(sql), args):
            in_reasoning = not in_text
            out.append(Hit(str(conv), int(mid), str(role), float(ts or 0),
                           str(snip_reason if in_reasoning else snip_text), in_reasoning, str(title),
                           str(persona), str(model), str(source)))
        return out

    def matching_ids(self, text: str, reasoning: bool = False) -> set[str]:
        """Conversations with a message matching ``text`` (``ls --grep``)."""
        q = fts_query(text)
        if not q:
            return set()
        match = q if reasoning else "text : (" + q + ")"
        return {str(r[0]) for r in self.db().execute("SELECT DISTINCT conv FROM hits WHERE hits MATCH ?", (match,))}

    def changed_since(self, seq: int) -> tuple[int, list[str]]:
        """(the current change number, conversations changed after ``seq``, removed ones included)."""
        db = self.db()
        now = int(db.execute("SELECT value FROM info WHERE key='seq'").fetchone()[0])
        if now == seq:
            return now, []
        return now, [str(r[0]) for r in db.execute(
            "SELECT id FROM convs WHERE seq > ? UNION SELECT conv FROM removed WHERE seq > ?", (seq, seq))]

    def stamps(self) -> dict[str, tuple[int, int]]:
        """Each conversation's transcript (size, mtime) as last indexed."""
        return {str(c): (int(a), int(b)) for c, a, b in self.db().execute("SELECT id, tx_size, tx_mtime FROM convs")}

    def ids(self) -> set[str]:
        return {str(r[0]) for r in self.db().execute("SELECT id FROM convs")}

    # -- rows other indexes keep here (the server's prefix index) --------------------------------------

    def extra(self, name: str) -> Iterator[tuple[str, str]]:
        yield from ((str(c), str(v)) for c, v in self.db().execute(
            "SELECT conv, value FROM extra WHERE name=?", (name,)).fetchall())

    def put_extra(self, name: str, values: Iterable[tuple[str, str | None]]) -> None:
        with self.write() as w:
            for cid, value in values:
                if value is None:
                    w.execute("DELETE FROM extra WHERE name=? AND conv=?", (name, cid))
                else:
                    w.execute("INSERT OR REPLACE INTO extra VALUES(?, ?, ?)", (name, cid, value))

    def prefix_rows(self, name: str) -> PrefixRows:
        """The server's prefix rows kept under ``name`` in this index (tables made if missing: an index
        made by an older chatcli has none, and adding them is cheaper than a rebuild)."""
        rows = PrefixRows(self.db, self.write, self._lock, name)
        rows.ensure()
        return rows


# The rows' table was ``prefix_convs`` until index format 4, which also stored the persona's messages a second
# time (its key, now made from the persona document when needed). A server of format 4 may still run on
# the same data directory: its table is left to it (its rows are under its own names in the others).
_PREFIX_SCHEMA = """
CREATE TABLE IF NOT EXISTS prefix_conv_rows(
    name TEXT NOT NULL, conv TEXT NOT NULL,
    size INTEGER NOT NULL, mtime INTEGER NOT NULL,  -- the transcript this row was built from
    root TEXT NOT NULL,         -- the key of its persona ('' : not usable by this server)
    persona TEXT,               -- {"messages", "name", "hash"} as JSON (NULL: not usable)
    counted INTEGER NOT NULL,   -- 1: it has boundaries, counted in prefix_personas under its messages' JSON
    updated REAL NOT NULL, n_active INTEGER NOT NULL, owner TEXT NOT NULL,
    UNIQUE(name, conv));
CREATE INDEX IF NOT EXISTS prefix_conv_rows_root ON prefix_conv_rows(name, root, owner);
CREATE TABLE IF NOT EXISTS prefix_keys(
    name TEXT NOT NULL, conv TEXT NOT NULL, k INTEGER NOT NULL, key TEXT NOT NULL, pos INTEGER NOT NULL,
    rest INTEGER NOT NULL, updated REAL NOT NULL, owner TEXT NOT NULL,
    warm INTEGER NOT NULL,      -- it had a state file when indexed: a hint to order candidates, checked after
    PRIMARY KEY(name, conv, k)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS prefix_keys_key ON prefix_keys(name, key, owner, warm DESC, rest, updated DESC, conv);
CREATE TABLE IF NOT EXISTS prefix_personas(name TEXT NOT NULL, persona TEXT NOT NULL, owner TEXT NOT NULL,
    n INTEGER NOT NULL, PRIMARY KEY(name, persona, owner)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS prefix_counts(name TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
"""


# What ``PrefixRows.put`` stores for one conversation: (id, transcript size, mtime, root, persona document,
# persona key (None: no boundaries; counted in prefix_personas, not kept in the row), updated, messages
# active, owner, warm, boundaries as (key, k, pos)).
PrefixPut = tuple[str, int, int, str, str | None, str | None, float, int, str, bool, list[tuple[str, int, int]]]


class PrefixKeyRow(NamedTuple):
    """One boundary of one conversation, as ``PrefixRows.lookup`` returns it."""

    conv: str
    k: int
    pos: int
    rest: int
    updated: float
    owner: str


class PrefixRows:
    """The server's prefix index (``server/index.py``) as tables, looked up per request: a lookup reads the
    rows of the request's keys (at most ``limit`` a key and owner, through an index in the order the server
    prefers them), so neither a server's start nor a request reads a row per stored conversation.

    Used on the shared index's connection, or on a private in-memory database (``in_memory``) when there is
    no usable shared index. ``rows_read`` counts the rows read back (tests check what a start and a request
    cost by it)."""

    def __init__(self, db: Callable[[], sqlite3.Connection], write: Callable[..., Index._tx],
                 lock: threading.RLock, name: str) -> None:
        self._db = db
        self.write = write
        self._lock = lock
        self.name = name
        self.rows_read = 0

    @classmethod
    def in_memory(cls, name: str) -> PrefixRows:
        db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        lock = threading.RLock()
        rows = cls(lambda: db, lambda timeout=None: Index._tx(db, lock, timeout), lock, name)
        rows.ensure()
        return rows

    def ensure(self) -> None:
        with self._lock:
            db = self._db()
            if db.execute("SELECT 1 FROM sqlite_master WHERE name='prefix_conv_rows'").fetchone() is None:
                with self.write() as w:
                    for stmt in _PREFIX_SCHEMA.split(";"):
                        if stmt.strip():
                            w.execute(stmt)
                    # Rows made before the count was kept (none, unless an earlier build of these tables).
                    w.execute("INSERT OR IGNORE INTO prefix_counts SELECT name, COUNT(*) FROM prefix_conv_rows "
                              "GROUP BY name")

    def _read(self, sql: str, args: Iterable[Any]) -> list[Any]:
        with self._lock:  # not in the middle of another thread's transaction on the shared connection
            got = self._db().execute(sql, tuple(args)).fetchall()
        self.rows_read += len(got)
        return got

    # -- writing -------------------------------------------------------------------------------------

    def put(self, cid: str, size: int, mtime: int, root: str, persona: str | None, persona_key: str | None,
            updated: float, n_active: int, owner: str, warm: bool, entries: Iterable[tuple[str, int, int]]) -> None:
        """The conversation's row and its boundaries' (key, k, pos), replacing what it had."""
        with self.write() as w:
            if not self._drop(w, cid):
                self._add_count(w, 1)
            w.execute("INSERT INTO prefix_conv_rows VALUES(?,?,?,?,?,?,?,?,?,?)",
                      (self.name, cid, size, mtime, root, persona, int(persona_key is not None), updated, n_active,
                       owner))
            w.executemany("INSERT OR REPLACE INTO prefix_keys VALUES(?,?,?,?,?,?,?,?,?)",
                          [(self.name, cid, k, key, pos, n_active - k, updated, owner, int(warm))
                           for key, k, pos in entries])
            if persona_key is not None:
                w.execute("INSERT INTO prefix_personas VALUES(?,?,?,1) ON CONFLICT(name, persona, owner) "
                          "DO UPDATE SET n = n + 1", (self.name, persona_key, owner))

    def put_many(self, puts: list[PrefixPut]) -> None:
        """``put`` for each, with one statement per table for all of them (a first build puts thousands)."""
        latest = {p[0]: p for p in puts}  # one row per conversation, as successive puts leave it
        with self.write() as w:
            known = self._known(w, list(latest))
            for cid in known:
                self._drop(w, cid)
            self._add_count(w, len(latest) - len(known))
            w.executemany("INSERT INTO prefix_conv_rows VALUES(?,?,?,?,?,?,?,?,?,?)",
                          [(self.name, *p[:5], int(p[5] is not None), *p[6:9]) for p in latest.values()])
            w.executemany("INSERT OR REPLACE INTO prefix_keys VALUES(?,?,?,?,?,?,?,?,?)",
                          [(self.name, p[0], k, key, pos, p[7] - k, p[6], p[8], int(p[9]))
                           for p in latest.values() for key, k, pos in p[10]])
            personas: dict[tuple[str, str], int] = {}
            for p in latest.values():
                if p[5] is not None:
                    personas[(p[5], p[8])] = personas.get((p[5], p[8]), 0) + 1
            w.executemany("INSERT INTO prefix_personas VALUES(?,?,?,?) ON CONFLICT(name, persona, owner) "
                          "DO UPDATE SET n = n + excluded.n", [(self.name, k, o, n) for (k, o), n in personas.items()])

    def _known(self, w: sqlite3.Connection, cids: list[str]) -> list[str]:
        out: list[str] = []
        for start in range(0, len(cids), 500):
            part = cids[start:start + 500]
            out += [str(r[0]) for r in w.execute(
                f"SELECT conv FROM prefix_conv_rows WHERE name=? AND conv IN ({','.join('?' * len(part))})",
                (self.name, *part))]
        return out

    def bulk(self, on: bool = True) -> contextlib.AbstractContextManager[None]:
        """Many puts to come: see ``bulk_writes``."""
        return bulk_writes(self._db(), on)

    def drop(self, cid: str) -> bool:
        """Forget the conversation; whether it was known."""
        with self.write() as w:
            known = self._drop(w, cid)
            if known:
                self._add_count(w, -1)
            return known

    def _add_count(self, w: sqlite3.Connection, n: int) -> None:
        # Kept with the rows (in their transactions) so that counting them costs no scan: /health says it.
        w.execute("INSERT INTO prefix_counts VALUES(?, ?) ON CONFLICT(name) DO UPDATE SET n = n + ?",
                  (self.name, n, n))

    def _drop(self, w: sqlite3.Connection, cid: str) -> bool:
        row = w.execute("SELECT persona, counted, owner FROM prefix_conv_rows WHERE name=? AND conv=?",
                        (self.name, cid)).fetchone()
        if row is None:
            return False
        if row[1] and row[0] is not None:
            # Its key, as ``put`` was given it: the persona's messages as JSON (the server's json.dumps).
            key = json.dumps(json.loads(row[0])["messages"], ensure_ascii=False)
            w.execute("UPDATE prefix_personas SET n = n - 1 WHERE name=? AND persona=? AND owner=?",
                      (self.name, key, row[2]))
            w.execute("DELETE FROM prefix_personas WHERE name=? AND persona=? AND owner=? AND n <= 0",
                      (self.name, key, row[2]))
        w.execute("DELETE FROM prefix_keys WHERE name=? AND conv=?", (self.name, cid))
        w.execute("DELETE FROM prefix_conv_rows WHERE name=? AND conv=?", (self.name, cid))
        return True

    def set_warm(self, cid: str, warm: bool) -> None:
        with self.write() as w:
            w.execute("UPDATE prefix_keys SET warm=? WHERE name=? AND conv=?", (int(warm), self.name, cid))

    # -- reading -------------------------------------------------------------------------------------

    def stamp(self, cid: str) -> tuple[int, int, str, bool] | None:
        """(transcript size, mtime, owner, warm) the conversation's row was built from; None if unknown."""
        got = self._read("SELECT c.size, c.mtime, c.owner, COALESCE((SELECT warm FROM prefix_keys k WHERE "
                         "k.name=c.name AND k.conv=c.conv LIMIT 1), 0) FROM prefix_conv_rows c "
                         "WHERE c.name=? AND c.conv=?", (self.name, cid))
        return None if not got else (int(got[0][0]), int(got[0][1]), str(got[0][2]), bool(got[0][3]))

    def stamps(self, cids: list[str]) -> dict[str, tuple[int, int, str, bool]]:
        """``stamp`` of each of these conversations that has a row."""
        out: dict[str, tuple[int, int, str, bool]] = {}
        for start in range(0, len(cids), 500):
            part = cids[start:start + 500]
            for cid, size, mtime, owner, warm in self._read(
                    "SELECT c.conv, c.size, c.mtime, c.owner, COALESCE((SELECT warm FROM prefix_keys k WHERE "
                    "k.name=c.name AND k.conv=c.conv LIMIT 1), 0) FROM prefix_conv_rows c "
                    f"WHERE c.name=? AND c.conv IN ({','.join('?' * len(part))})", (self.name, *part)):
                out[str(cid)] = (int(size), int(mtime), str(owner), bool(warm))
        return out

    def ids(self) -> list[str]:
        return [str(r[0]) for r in self._read("SELECT conv FROM prefix_conv_rows WHERE name=?", (self.name,))]

    def count(self) -> int:
        with self._lock:
            row = self._db().execute("SELECT n FROM prefix_counts WHERE name=?", (self.name,)).fetchone()
        return 0 if row is None else int(row[0])

    def lookup(self, key: str, *, owners: frozenset[str] | None, only: str | None, limit: int) -> list[PrefixKeyRow]:
        """The boundaries at ``key``: at most ``limit`` per owner, those that had a state file first, then
        the conversations that go least beyond it, the most recently updated."""
        cols = "conv, k, pos, rest, updated, owner"
        order = "ORDER BY warm DESC, rest, updated DESC, conv LIMIT ?"
        if only is not None:  # one conversation's own boundaries (its primary key), not the key's
            rows = self._read(f"SELECT {cols} FROM prefix_keys WHERE name=? AND conv=? AND key=?",
                              (self.name, only, key))
            rows = [r for r in rows if owners is None or r[5] in owners]
        elif owners is None:
            rows = self._read(f"SELECT {cols} FROM prefix_keys WHERE name=? AND key=? {order}", (self.name, key, limit))
        else:
            rows = []
            for owner in sorted(owners):  # one index range each, read in order and cut at the limit
                rows += self._read(f"SELECT {cols} FROM prefix_keys WHERE name=? AND key=? AND owner=? {order}",
                                   (self.name, key, owner, limit))
        return [PrefixKeyRow(str(c), int(k), int(p), int(r), float(u), str(o)) for c, k, p, r, u, o in rows]

    def personas(self, owners: frozenset[str] | None) -> list[str]:
        """The persona keys (JSON) of conversations with boundaries, of ``owners`` when given."""
        rows = self._read("SELECT persona, owner FROM prefix_personas WHERE name=? ORDER BY persona", (self.name,))
        return list(dict.fromkeys(str(p) for p, o in rows if owners is None or o in owners))

    def persona_for_root(self, root: str, owners: frozenset[str] | None) -> str | None:
        """The persona (JSON) of the first indexed conversation with this root, of ``owners`` when given."""
        if owners is None:
            got = self._read("SELECT rowid, persona FROM prefix_conv_rows WHERE name=? AND root=? AND persona IS NOT "
                             "NULL ORDER BY rowid LIMIT 1", (self.name, root))
        else:
            got = []
            for owner in owners:
                got += self._read("SELECT rowid, persona FROM prefix_conv_rows WHERE name=? AND root=? AND owner=? "
                                  "AND persona IS NOT NULL ORDER BY rowid LIMIT 1", (self.name, root, owner))
        return str(min(got)[1]) if got else None

    def dump(self) -> dict[str, dict[str, Any]]:
        """Every row (the JSON file kept without a shared index)."""
        out: dict[str, dict[str, Any]] = {}
        for cid, size, mtime, root, persona, updated, n_active, owner in self._read(
                "SELECT conv, size, mtime, root, persona, updated, n_active, owner FROM prefix_conv_rows WHERE name=? "
                "ORDER BY rowid", (self.name,)):
            out[str(cid)] = {"size": size, "mtime": mtime, "root": root,
                             "persona": None if persona is None else json.loads(persona), "updated": updated,
                             "entries": [], "n_active": n_active, "owner": owner, "warm": False}
        for cid, key, k, pos, warm in self._read("SELECT conv, key, k, pos, warm FROM prefix_keys WHERE name=? "
                                                 "ORDER BY conv, k", (self.name,)):
            out[str(cid)]["entries"].append([key, k, pos])
            out[str(cid)]["warm"] = bool(warm)
        return out
