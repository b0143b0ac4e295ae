"""The append-only KV state file (``state.kv``) of a conversation, and the persona prefix cache files.

A state file is a sequence of checksummed records::

    magic "CKV1" | kind u8 | reserved u8 u16 | p0 i32 | p1 i32 | length u64 | crc32 u32 | payload

- ``HEADER``   JSON: format version, model identity and context parameters the cells belong to.
- ``CELLS``    cells of positions [p0, p1): their token ids (int32 each) then llama.cpp's sequence-state
               bytes. One per turn, so a snapshot costs O(new tokens), not O(context).
- ``TRUNCATE`` the context was rolled back to p0 tokens.
- ``SNAPSHOT`` like CELLS from position 0: replaces everything before it (compaction, context shift).
- ``LOGITS``   float32 logits after position p0-1: lets /regen sample again without re-evaluating.
- ``SPARE``    like CELLS, but never part of the state: cells a compaction kept because ``/redo`` or ``/alt``
               can still bring them back (read back by ``CellLog.put_back``; older versions skip the kind).
- ``REVIVE``   payload ``offset u64 | crc u32``: the CELLS, SPARE or SNAPSHOT record of positions [p0, p1) at
               that offset of the same file (an earlier record, its stored crc) is part of the state again,
               as CELLS (or, from position 0, as SNAPSHOT): what ``/redo`` and ``/alt`` append after reading
               cells back, instead of a copy of them. A reader indexes it as that record (``Record.of``).
- ``REVIVE_LOGITS`` the same for an earlier LOGITS record at p0 (= p1): the logits a /redo or /alt brings
               back with the user message they follow, so /regen right after it evaluates nothing.
- ``HISTORY``  payload: a digest of the token ids before p0 (``history_digest``), for the CELLS or SPARE
               record of cells from p0 >= 1 right after it: the history those cells were computed on. /redo
               and /alt read dead cells back only where it is the current one (older versions skip the kind;
               a record without one, written before it, is read back by its positions and tokens alone).
- ``BASE``     JSON ``{file, length, header_crc, last_offset, last_crc}``: the records of another state file
               (``<this file's stem>.base-<hex>.kv`` in the same folder, a hard link to a fork parent's
               ``state.kv``), bytes [0, length), count as if they stood here. Only right after the header.

Forks share bytes instead of copying them. A state file's bytes [0, L) never change once written and
valid: records are appended, a torn tail past the last valid record is cut, and a rewrite is a new file
(temp file + rename, a new inode). So a fork hard-links the parent's file as its base (no byte copied) and
its own file holds the header, the BASE record and what differs (a TRUNCATE to the fork point). The BASE
record names the base's length and the stored crcs of its header and its last record: a base that is
missing, shorter, or another file is detected before any cell is used, and the state is then treated as
unusable (rebuilt from the transcript). A rewrite of the fork writes a self-contained file and removes its
base links; the parent's rewrites and deletion do not touch the fork's link.

The crc covers the header fields and the payload, so a torn or bit-flipped record is detected; reading
stops at the first bad record and the rest is treated as missing (re-evaluated from the transcript).
The file is a cache: the transcript is the truth, and deleting this file only costs a re-evaluation.

Versions (the rule is in core/files/migrations.py): the header's ``format`` is the file's major version; a newer one
is refused, never rebuilt over. A record of a kind this version does not know, but whose framing and crc
are sound, was added by a newer chatcli under the same major version: it is skipped, not taken for damage.
A BASE record must not be skipped (the cells after it continue the base's), so a file holding one says
format 2 (``BASE_FORMAT``), which chatcli versions before it refuse; every other file still says format 1,
readable by every version.

A REVIVE record keeps format 1 although an older reader cannot follow it: skipping it, that reader finds
the next CELLS record not continuing its state and treats the rest of the file as damage — it restores
what comes before, evaluates the rest from the transcript and rewrites the file. Slower, never wrong (the
cells it loads are those it reads as live, checked against the transcript), where a format bump would
make it refuse the whole conversation.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import secrets
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Self

from chatcli.core.files import migrations
from chatcli.core.files.fsutil import append_durably, atomic_write_with, write_all
from chatcli.errors import ChatcliError, Kind

MAGIC = b"CKV1"
FORMAT_VERSION = migrations.STATE_VERSION
PLAIN_FORMAT = 1  # a file without a BASE record: every chatcli reads it
BASE_FORMAT = 2  # the first format whose readers follow a BASE record
_HDR = struct.Struct("<4sBBHiiQI")  # magic kind flags reserved p0 p1 length crc
HEADER_SIZE = _HDR.size

HEADER, CELLS, TRUNCATE, SNAPSHOT, LOGITS, BASE, SPARE, REVIVE, REVIVE_LOGITS, HISTORY = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
# Record flags (the header's flags byte; older versions ignore it). NOT_A_POINT: cells saved while the
# sequence went on past p1, so the state that is not cells (a recurrent one) is not the state at p1 — a
# compaction of old turns on a hybrid memory. Loadable as cells, never rewound to.
NOT_A_POINT = 1
KIND_NAMES = {HEADER: "header", CELLS: "cells", TRUNCATE: "truncate", SNAPSHOT: "snapshot", LOGITS: "logits",
              BASE: "base", SPARE: "spare", REVIVE: "revive", REVIVE_LOGITS: "revive-logits",
              HISTORY: "history"}
_REVIVE = struct.Struct("<QI")  # a REVIVE record's payload: the revived record's offset and stored crc
REVIVED_KINDS = (CELLS, SPARE, SNAPSHOT)  # what a REVIVE record may make live again
REVIVES = (REVIVE, REVIVE_LOGITS)  # records that stand for an earlier one (``Record.of``)
_MAX_PAYLOAD = 1 << 36
MAX_BASE_DEPTH = 8  # a fork of a fork of ... : deeper chains are copied instead (forking.py)
_BASE_NAME = re.compile(r"^[A-Za-z0-9_-]+\.base-[0-9a-f]{8,32}\.kv$")


class StateFileError(ChatcliError, ValueError):
    """The state file is unusable as a whole (foreign, wrong version, other model)."""

    kind: Kind = "io"


@dataclass
class Record:
    kind: int
    p0: int
    p1: int
    offset: int  # of the record header in the file
    length: int  # payload bytes
    file: Path | None = None  # the base file holding it (None: the state file itself)
    flags: int = 0  # NOT_A_POINT
    # A REVIVE record: the record it makes live again, as the state sees it (kind CELLS, or SNAPSHOT from
    # position 0), with the revived record's offset, length, file and flags, so that its cells are read
    # from there. That view's ``via`` is the REVIVE record's offset (-1 on every other record): a reader
    # checking crcs in file order waits for the REVIVE record, not only for the older one it names.
    of: Record | None = field(default=None, repr=False, compare=False)
    via: int = -1
    # The digest of the tokens before p0 the cells were computed after (its HISTORY record), when saved.
    history: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def is_point(self) -> bool:
        """Saved where the sequence ended at p1 (so on a memory that cannot be cut back its bytes hold the
        state there), which every CELLS and SNAPSHOT record is unless flagged otherwise."""
        return self.kind in (CELLS, SNAPSHOT) and not self.flags & NOT_A_POINT

    @property
    def size(self) -> int:
        return HEADER_SIZE + self.length


Buffer = bytes | memoryview


class RecordParts:
    """An encoded record kept as its parts (header with crc, then the payload's parts), never joined: a
    reply's second token waits for the user message's CELLS record (~11 MB for 465 tokens of the bundled
    model), and each copy of that size cost 5-9 ms (its pages are new to the process each time). The parts
    go to the file one after the other (``fsutil.write_all``); the bytes on disk are those of the joined record."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Sequence[Buffer]) -> None:
        self.parts: tuple[Buffer, ...] = tuple(parts)
        self.nbytes = sum(_nbytes(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes


Raw = bytes | RecordParts
"""An encoded record: its bytes, or its parts."""


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def raw_parts(raw: Raw) -> tuple[Buffer, ...]:
    return (raw,) if isinstance(raw, bytes) else raw.parts


def raw_bytes(raw: Raw) -> bytes:
    return raw if isinstance(raw, bytes) else b"".join(raw.parts)


def encode_record(kind: int, p0: int, p1: int, payload: bytes, flags: int = 0) -> bytes:
    return raw_bytes(encode_record_parts(kind, p0, p1, (payload,), flags))


def encode_record_parts(kind: int, p0: int, p1: int, parts: Sequence[Buffer], flags: int = 0) -> RecordParts:
    """``encode_record`` of the payload ``b"".join(parts)``, as parts: nothing is copied (see ``RecordParts``)."""
    head = struct.pack("<4sBBHiiQ", MAGIC, kind, flags, 0, p0, p1, sum(_nbytes(p) for p in parts))
    crc = zlib.crc32(head)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return RecordParts((head + struct.pack("<I", crc), *parts))


def records_at(raws: Sequence[Raw], offset: int) -> tuple[list[Record], int]:
    """Index encoded records written at ``offset``: their headers (and histories), and the offset after
    the last one."""
    out: list[Record] = []
    for raw in raws:
        _, kind, flags, _, p0, p1, length, _ = _HDR.unpack_from(raw_parts(raw)[0], 0)
        rec = Record(kind, p0, p1, offset, length, flags=flags)
        # Only a HISTORY record is joined (a few bytes): cells are parts, never copied.
        _follow_history(rec, out[-1] if out else None, raw_bytes(raw)[HEADER_SIZE:] if kind == HISTORY else b"")
        out.append(rec)
        offset += len(raw)
    return out, offset


def history_digest(tokens: Sequence[int]) -> bytes:
    """A HISTORY record's payload: the digest of the token ids before a record's p0."""
    import numpy as np  # lazily, as in cells_parts

    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).digest()[:16]


def history_record(p0: int, before: Sequence[int]) -> bytes:
    """The HISTORY record of cells from ``p0`` computed after the tokens ``before`` (``len(before) == p0``)."""
    return encode_record(HISTORY, p0, p0, history_digest(before))


def _follow_history(rec: Record, prev: Record | None, payload: bytes | memoryview) -> None:
    """Index ``rec`` after ``prev`` (the record right before it in the same file): a HISTORY record keeps its
    digest until the next record, which takes it when it is cells from that position."""
    if rec.kind == HISTORY:
        rec.history = bytes(payload)
    elif prev is not None and prev.kind == HISTORY and rec.kind in (CELLS, SPARE) and prev.p0 == rec.p0 > 0:
        rec.history = prev.history


def revive_payload(offset: int, crc: int) -> bytes:
    """A REVIVE record's payload: the revived record's offset (in the same file) and its stored crc."""
    return _REVIVE.pack(offset, crc)


def revived(rec: Record, payload: bytes | memoryview, target: Record | None, target_crc: int | None) -> Record | None:
    """The view a REVIVE (or REVIVE_LOGITS) record ``rec`` makes live (see ``Record.of``), or None if it does
    not name ``target`` (the record at its payload's offset, with ``target_crc`` stored; None: not compared)
    as a record of its cells (of its logits)."""
    if len(payload) != _REVIVE.size or target is None:
        return None
    offset, crc = _REVIVE.unpack(payload)
    if target.offset != offset or (target_crc is not None and crc != target_crc) or target.offset >= rec.offset:
        return None
    if rec.kind == REVIVE_LOGITS:
        if target.kind != LOGITS or not target.p0 == target.p1 == rec.p0 == rec.p1:
            return None
        kind = LOGITS
    elif target.kind not in REVIVED_KINDS or (target.p0, target.p1) != (rec.p0, rec.p1) or target.p1 <= target.p0:
        return None
    else:
        kind = live_kind(rec.p0)
    return Record(kind, rec.p0, rec.p1, target.offset, target.length, file=target.file, flags=target.flags,
                  via=rec.offset, history=target.history)


def live_kind(p0: int) -> int:
    """The kind of a record of cells from ``p0`` as the state sees it (a revived or spare record made live):
    from position 0 it replaces everything before it."""
    return SNAPSHOT if p0 == 0 else CELLS


def revive_target(payload: bytes | memoryview) -> int:
    """The offset a REVIVE record's payload names (-1 when it is not one)."""
    return int(_REVIVE.unpack(payload)[0]) if len(payload) == _REVIVE.size else -1


def cells_payload(tokens: list[int], kv: Buffer) -> bytes:
    return b"".join(cells_parts(tokens, kv))


def cells_parts(tokens: list[int], kv: Buffer) -> tuple[bytes, Buffer]:
    """A CELLS/SNAPSHOT payload in its two parts (token ids, llama.cpp's cell bytes): ``encode_record_parts``."""
    import numpy as np  # here, not at the top: `chatcli ls` reads headers and must not load numpy

    return np.asarray(tokens, dtype="<i4").tobytes(), kv


def record_size_for_cells(n_tokens: int, kv_bytes: int) -> int:
    """Bytes a CELLS record of ``n_tokens`` takes: header, token ids, llama.cpp's cell bytes."""
    return HEADER_SIZE + 4 * n_tokens + kv_bytes


@dataclass
class LiveChunk:
    """A CELLS/SNAPSHOT record that still contributes cells [p0, end)."""

    record: Record
    end: int


@dataclass
class ScanResult:
    """What reading a state file found."""

    header: dict[str, Any] | None
    records: list[Record] = field(default_factory=list)
    valid_bytes: int = 0  # everything after this offset is torn/corrupt
    dropped_bytes: int = 0
    problem: str = ""
    newer_format: bool = False  # written by a newer chatcli: unusable here, and not to be overwritten
    bases: list[str] = field(default_factory=list)  # base file names, outermost first (nested bases after)
    base_bytes: int = 0  # bytes of the bases counted as this state's (their lengths)
    depth: int = 0  # how many bases deep the chain goes

    def live(self) -> tuple[list[LiveChunk], Record | None, int]:
        """Replay the records: the live chunks, the live logits record, and the state's length."""
        chunks: list[LiveChunk] = []
        logits: Record | None = None
        n = 0
        for rec in self.records:
            if rec.kind in REVIVES:
                if rec.of is None:
                    break  # not resolved (the scan stops at such a record, so only a writer bug)
                rec = rec.of
            if rec.kind == SNAPSHOT:
                chunks = [LiveChunk(rec, rec.p1)]
                n = rec.p1
                if logits is not None and logits.p0 > n:
                    logits = None
            elif rec.kind == CELLS:
                if rec.p0 != n:
                    # A chunk that does not continue the state means a writer bug or a foreign file:
                    # everything from here on is unusable.
                    break
                if rec.p1 > rec.p0:
                    # Not an empty one: an empty persona prefix (an API conversation without a system
                    # message) was saved as a record of no cells, and a restore stopped at it, evaluating
                    # the whole conversation again (such files exist).
                    chunks.append(LiveChunk(rec, rec.p1))
                n = rec.p1
            elif rec.kind == TRUNCATE:
                to = rec.p0
                kept: list[LiveChunk] = []
                for ch in chunks:
                    if ch.record.p0 >= to:
                        continue
                    ch.end = min(ch.end, to)
                    kept.append(ch)
                chunks = [c for c in kept if c.end > c.record.p0]
                n = min(n, to)
                if logits is not None and logits.p0 > to:
                    logits = None
            elif rec.kind == LOGITS:
                logits = rec if rec.p0 <= n else None
        return chunks, logits, n

    def points(self) -> list[Record]:
        """The records whose end is still a point the sequence can be rewound to, in file order.

        Every CELLS or SNAPSHOT record was saved when the sequence ended at its p1, so on a memory that
        cannot be cut back (recurrent, hybrid, whole-sequence) it also holds the state there. It stays a
        valid point until a TRUNCATE below its end replaces what came before it; a later record does not
        invalidate it (the sequence still begins with the same tokens), and a rewrite starts a new file.
        """
        pts: list[Record] = []
        for rec in self.records:
            rec = rec.of if rec.kind in REVIVES and rec.of is not None else rec
            if rec.is_point:
                pts.append(rec)
            elif rec.kind == TRUNCATE:
                pts = [r for r in pts if r.p1 <= rec.p0]
        return pts

    def add(self, raws: Sequence[Raw]) -> None:
        """Index records just appended at the end of the valid bytes (the file's only writer calls this)."""
        added, self.valid_bytes = records_at(raws, self.valid_bytes)
        for rec, raw in zip(added, raws, strict=True):
            if rec.kind in REVIVES:
                payload = raw_bytes(raw)[HEADER_SIZE:]  # a few bytes: REVIVE records are never parts
                at = revive_target(payload)
                target = next((r for r in reversed(self.records) if r.file is None and r.offset == at), None)
                rec.of = revived(rec, payload, target, None)  # this process wrote it, with the crc it read
            self.records.append(rec)

    def live_bytes(self, *, own: bool = False) -> int:
        """Bytes of the records still in use; ``own``: only those in the file itself (not its bases)."""
        chunks, logits, _ = self.live()
        recs = [c.record for c in chunks] + ([logits] if logits else [])
        total = sum(r.size for r in recs if not own or r.file is None)
        if own:  # the BASE record is what keeps the base's cells live
            total += sum(r.size for r in self.records if r.kind == BASE and r.file is None)
        if self.records and self.records[0].kind == HEADER:
            total += self.records[0].size
        return total


def scan(path: Path) -> ScanResult:
    """Read record headers, checking every payload's crc (payloads are not kept in memory)."""
    try:
        check_format(path)
    except migrations.FormatError as exc:
        return ScanResult(header=None, problem=str(exc), newer_format=True, dropped_bytes=0)
    with map_state(path) as ms:
        return ms.result


class MappedState:
    """A state file mapped read-only, its records indexed and each payload's crc checked exactly once.

    The fast path of a restore: the file is read in one pass (the crc pass brings it into memory through
    the mapping, no copy), and ``cells``/``payload`` hand out views into the mapping that can go straight
    to llama.cpp. Close it (or use it as a context manager) before anything writes to the file: a view read
    after the file shrank would fault.

    A file with a BASE record maps its base too (only the base's first ``length`` bytes): the base's
    records come first in ``records`` (each with ``file`` set), then the file's own.

    ``background=True`` checks the crcs in a second thread, record after record, while the caller already
    works on the records checked so far (``wait_ok``): a restore then costs about max(crc, load) instead of
    their sum. ``records`` is the index from the record headers alone; ``result`` (which waits for the
    checks) is the scan's answer, the same as ``scan()``'s.
    """

    def __init__(self, path: Path, *, background: bool = False, check: bool = True) -> None:
        self.path = path
        self._maps: list[mmap.mmap] = []
        self._views: dict[Path | None, memoryview] = {}
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._n_ok = 0  # records[:_n_ok] are checked and good
        self._bad: int | None = None  # index of the first record whose crc is wrong
        self._stop = False
        self._final: ScanResult | None = None
        self._index: dict[tuple[Path | None, int], int] = {}
        self._populate = check or background  # an index alone reads only the record headers' pages
        view, problem = self._map(path, None, None)
        if view is None:
            self.records = self._final = ScanResult(header=None, problem=problem)
            return
        now = check and not background  # check the crcs during the scan itself
        res, self._crcs = _scan_buffer(view, check_crc=now, resolve=lambda info, ident: self._base(info, ident, now, 1))
        self.records = res
        self._index = {(r.file, r.offset): i for i, r in enumerate(res.records)}
        if not background or not res.records:  # nothing to check in a thread (an empty or unreadable file)
            self._final = res
            self._n_ok = len(res.records)
            return
        self._thread = threading.Thread(target=self._check_all, name="statefile-crc", daemon=True)
        self._thread.start()

    def _map(self, path: Path, key: Path | None, length: int | None) -> tuple[memoryview | None, str]:
        """Map ``path`` (its first ``length`` bytes if given) and remember the view under ``key``."""
        try:
            fh = path.open("rb")
        except FileNotFoundError:
            return None, "missing"
        except OSError as exc:
            return None, f"unreadable ({exc.strerror or exc})"
        with fh:
            size = os.fstat(fh.fileno()).st_size
            if length is not None:
                if size < length:
                    return None, "shorter than recorded"
                size = length
            view = memoryview(b"")
            if size:
                # MAP_POPULATE (Linux) maps every page in one call instead of one fault per few pages: the
                # whole file is about to be read anyway.
                populate = getattr(mmap, "MAP_POPULATE", 0) if self._populate else 0
                if populate:
                    mm = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
                else:
                    mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
                self._maps.append(mm)
                view = memoryview(mm)
        self._views[key] = view
        return view, ""

    def _base(self, info: dict[str, Any], identity: object, check_crc: bool,
              depth: int) -> tuple[list[Record], list[int], ScanResult | None, str]:
        """Map and index a BASE record's file: its records (header excluded), their stored crcs, its scan."""
        name, length = info.get("file"), info.get("length")
        if not (isinstance(name, str) and _BASE_NAME.match(name) and isinstance(length, int) and length > 0):
            return [], [], None, "unreadable base record"
        if depth > MAX_BASE_DEPTH:
            return [], [], None, "bases nested too deep"
        path = self.path.parent / name
        if path in self._views:
            return [], [], None, f"base {name} named twice"
        view, problem = self._map(path, path, length)
        if view is None:
            return [], [], None, f"shared base {name} {problem}"
        res, crcs = _scan_buffer(view, check_crc=check_crc,
                                 resolve=lambda i, ident: self._base(i, ident, check_crc, depth + 1), file=path)
        if res.header is None or res.valid_bytes != length:
            return [], [], None, f"shared base {name} unusable ({res.problem or 'shorter than recorded'})"
        # The base's own last record (its records list ends with its own base's when it holds only a
        # header and a BASE record itself).
        i_last = max(i for i, r in enumerate(res.records) if r.file == path)
        last = res.records[i_last]
        if (res.header.get("identity") != identity or crcs[0] != info.get("header_crc")
                or last.offset != info.get("last_offset") or crcs[i_last] != info.get("last_crc")):
            return [], [], None, f"shared base {name} does not match"
        res.bases.insert(0, name)
        res.depth += 1
        return res.records[1:], crcs[1:], res, ""

    def stored_crc(self, rec: Record) -> int:
        """The crc a record's header stores (with ``check=False``, not yet compared to its payload)."""
        return self._crcs[self._index[(rec.file, rec.offset)]]

    def _view_of(self, rec: Record) -> memoryview:
        view = self._views.get(rec.file)
        if view is None:
            raise StateFileError("state file is closed or empty")
        return view

    def _check_all(self) -> None:
        for i, rec in enumerate(self.records.records):
            if self._stop:
                return
            ok = _record_crc(self._view_of(rec), rec) == self._crcs[i]
            with self._cond:
                if ok:
                    self._n_ok = i + 1
                else:
                    self._bad = i
                self._cond.notify_all()
            if not ok:
                return

    def wait_ok(self, rec: Record) -> bool:
        """Whether ``rec`` and every record before it have a good crc (waits for the check); for a revived
        record's view, the REVIVE record and every record before it."""
        i = self._index.get((rec.file, rec.via if rec.via >= 0 else rec.offset))
        if i is None:
            return False
        if self._thread is None:
            return True
        with self._cond:
            self._cond.wait_for(lambda: self._n_ok > i or self._bad is not None)
            return self._n_ok > i

    @property
    def result(self) -> ScanResult:
        """The scan: records up to the first damaged one, as ``scan()`` reports them."""
        if self._final is None:
            assert self._thread is not None
            self._thread.join()
            res = self.records
            if self._bad is None:
                self._final = res
            else:
                bad = res.records[self._bad]
                size = res.valid_bytes + res.dropped_bytes
                if bad.file is not None:
                    # A damaged base: the file's own records continue it, so none of them can be used.
                    self._final = ScanResult(header=None, records=res.records[:self._bad], valid_bytes=0,
                                             dropped_bytes=size, problem=f"checksum mismatch in shared base {bad.file.name}")
                else:
                    cut = bad.offset
                    self._final = ScanResult(header=res.header, records=res.records[:self._bad], valid_bytes=cut,
                                             dropped_bytes=size - cut, problem="checksum mismatch",
                                             bases=res.bases, base_bytes=res.base_bytes, depth=res.depth)
        return self._final

    def payload(self, rec: Record) -> memoryview:
        """The payload of a record (check it with ``wait_ok`` first when checking in the background): a
        view into the mapping, not a copy."""
        start = rec.offset + HEADER_SIZE
        return self._view_of(rec)[start:start + rec.length]

    def record_bytes(self, rec: Record) -> memoryview:
        """The whole encoded record (header and payload), as in the file: a view into the mapping."""
        return self._view_of(rec)[rec.offset:rec.offset + rec.size]

    def cells(self, rec: Record) -> tuple[list[int], memoryview]:
        """A CELLS/SNAPSHOT record's token ids and a view of its llama.cpp cell bytes."""
        return split_cells(self.payload(rec), rec.p1 - rec.p0)

    def close(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._thread.join()
        views, maps = list(self._views.values()), self._maps
        self._views, self._maps = {}, []
        for view in views:
            view.release()
        for mm in maps:
            try:
                mm.close()
            except BufferError:
                # A caller still holds a payload view: the mapping goes when the last view does.
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_state(path: Path, *, background: bool = False, check: bool = True) -> MappedState:
    """``check=False``: index the records without checking their payloads' crcs (a fork that only refers
    to them: whoever reads the cells checks them)."""
    return MappedState(path, background=background, check=check)


_Resolve = Callable[[dict[str, Any], object], tuple[list[Record], list[int], "ScanResult | None", str]]


def _scan_buffer(buf: memoryview, *, check_crc: bool, resolve: _Resolve | None = None,
                 file: Path | None = None) -> tuple[ScanResult, list[int]]:
    """Index the records; with ``check_crc`` stop at the first bad crc, else return every record's stored
    crc for a later check (the header's and a BASE record's are always checked: their JSON is parsed here).
    A BASE record is resolved through ``resolve``; ``file`` tags the records of a base file."""
    size = len(buf)
    res = ScanResult(header=None)
    crcs: list[int] = []
    own: dict[int, int] = {}  # offset -> index in res.records of this buffer's records (a REVIVE names one)
    offset = 0
    n = 0  # the state's length so far, to check that every CELLS record continues it
    while offset < size:
        rec, crc, problem = _check_record(buf, offset, size, check_crc)
        if rec is None:
            res.problem = problem
            break
        rec.file = file
        if offset == 0:
            if rec.kind != HEADER:
                res.problem = "not a chatcli state file"
                break
            try:
                header = json.loads(bytes(buf[HEADER_SIZE:HEADER_SIZE + rec.length]))
            except ValueError:
                header = None
            if not isinstance(header, dict):
                res.problem = "unreadable header"
                break
            try:
                migrations.check("state file", header.get("format"), FORMAT_VERSION)
            except migrations.FormatError as exc:
                res.problem, res.newer_format = str(exc), True
                break
            except ValueError:
                res.problem = "unreadable header"
                break
            res.header = migrations.upgrade_state_header(header)
        elif rec.kind == HEADER:
            res.problem = "second header"
            break
        elif rec.kind == BASE:
            if len(res.records) != 1 or resolve is None:
                res.problem = f"misplaced base record at {offset}"
                break
            try:
                info = json.loads(bytes(buf[offset + HEADER_SIZE:offset + rec.size]))
            except ValueError:
                info = None
            identity = res.header.get("identity") if res.header is not None else None
            brecs, bcrcs, base, why = resolve(info, identity) if isinstance(info, dict) \
                else ([], [], None, "unreadable base record")
            if base is None:
                # The cells after this record continue the base's: without it nothing here is usable.
                res.header, res.problem = None, why
                break
            res.records.append(rec)
            crcs.append(crc)
            res.records.extend(brecs)
            crcs.extend(bcrcs)
            res.bases = base.bases
            res.base_bytes = int(info["length"]) + base.base_bytes
            res.depth = base.depth
            n = base.live()[2]
            offset += rec.size
            continue
        elif rec.kind in REVIVES:
            i = own.get(revive_target(buf[offset + HEADER_SIZE:offset + rec.size]), -1)
            rec.of = revived(rec, buf[offset + HEADER_SIZE:offset + rec.size], res.records[i] if i >= 0 else None,
                             crcs[i] if i >= 0 else None)
            if rec.of is None or (rec.p0 > n if rec.kind == REVIVE_LOGITS else rec.p0 and rec.p0 != n):
                # Names no record of its cells here, or does not continue the state: as a CELLS record
                # that does not (below), it and everything after it count as damaged.
                res.problem = f"revive record at {offset} names no record of the state's cells"
                break
        elif rec.kind == CELLS and rec.p0 != n:
            # Well-formed but not continuing the state (a writer bug, or records spliced from elsewhere):
            # it and everything after it count as damaged, so the writer cuts them instead of appending
            # new records behind one that makes every later reader stop.
            res.problem = f"record at {offset} does not continue the state ({rec.p0} != {n})"
            break
        if rec.kind in (CELLS, SNAPSHOT, REVIVE):
            n = rec.p1
        elif rec.kind == TRUNCATE:
            n = min(n, rec.p0)
        prev = res.records[-1] if res.records else None
        _follow_history(rec, prev if prev is not None and prev.file == file else None,
                        buf[offset + HEADER_SIZE:offset + rec.size] if rec.kind == HISTORY else b"")
        own[offset] = len(res.records)
        res.records.append(rec)
        crcs.append(crc)
        offset += rec.size
    res.valid_bytes = offset if res.header is not None else 0
    res.dropped_bytes = size - res.valid_bytes
    if res.header is None and not res.problem:
        res.problem = "empty"
    return res, crcs


def _record_crc(buf: memoryview, rec: Record) -> int:
    # zlib releases the GIL and reads the mapping directly: one pass, no copy.
    head = buf[rec.offset:rec.offset + HEADER_SIZE - 4]
    return zlib.crc32(buf[rec.offset + HEADER_SIZE:rec.offset + rec.size], zlib.crc32(head))


def _check_record(buf: memoryview, offset: int, size: int, check_crc: bool) -> tuple[Record | None, int, str]:
    if offset + HEADER_SIZE > size:
        return None, 0, "truncated record header"
    magic, kind, flags, _res, p0, p1, length, crc = _HDR.unpack_from(buf, offset)
    if magic != MAGIC:
        return None, 0, "bad magic" if offset else "not a chatcli state file"
    # An unknown kind is a record of a newer chatcli (same major version): the framing rules still hold.
    if length > _MAX_PAYLOAD or (kind in KIND_NAMES and (p0 < 0 or p1 < p0)):
        return None, 0, "bad record header"
    if offset + HEADER_SIZE + length > size:
        return None, 0, "truncated record"
    rec = Record(kind, p0, p1, offset, length, flags=flags)
    # The header's and a BASE record's JSON, and a REVIVE record's target, are read right away: their crc
    # is checked first, always.
    if (check_crc or kind in (HEADER, BASE, HISTORY, *REVIVES)) and _record_crc(buf, rec) != crc:
        return None, 0, "checksum mismatch"
    return rec, crc, ""


def check_format(path: Path) -> None:
    """Raise ``migrations.FormatError`` if ``path`` is a state file of a newer major version.

    Reads only the first record: cheap enough for every ``chatcli ls``. Damage is not reported here (a
    damaged cache is rebuilt by its reader); only a newer format, which must not be rebuilt over.
    """
    try:
        with path.open("rb") as fh:
            head = fh.read(HEADER_SIZE)
            if len(head) < HEADER_SIZE:
                return
            magic, kind, _flags, _res, _p0, _p1, length, _crc = _HDR.unpack(head)
            payload = fh.read(length) if magic == MAGIC and kind == HEADER and length <= 1 << 20 else b""
    except OSError:
        return
    if magic[:3] == MAGIC[:3] and magic[3:].isdigit() and int(magic[3:]) > int(MAGIC[3:]):
        # A newer record framing (its digit counts framings, not formats): refuse, never rebuild over it.
        migrations.check("state file record framing", int(magic[3:]), int(MAGIC[3:]))
    try:
        header = json.loads(payload) if payload else None
        if isinstance(header, dict):
            migrations.check("state file", header.get("format"), FORMAT_VERSION)
    except migrations.FormatError:
        raise
    except ValueError:
        return  # damage: the reader rebuilds the cache


def read_payload(path: Path, rec: Record) -> bytes:
    """A record's payload, its crc checked (from its base file when it came from one)."""
    with (rec.file or path).open("rb") as fh:
        fh.seek(rec.offset)
        data = fh.read(rec.size)
    if len(data) != rec.size:
        raise StateFileError("state file changed while reading")
    head = data[:HEADER_SIZE]
    crc = _HDR.unpack(head)[-1]
    if zlib.crc32(data[HEADER_SIZE:], zlib.crc32(head[:-4])) != crc:
        raise StateFileError("checksum mismatch")
    return data[HEADER_SIZE:]


def read_tokens(path: Path, rec: Record) -> list[int]:
    """The token ids at the start of a CELLS/SNAPSHOT/SPARE payload, without reading its cells (or checking
    its crc: whoever uses the cells reads the whole record with ``read_payload``)."""
    import numpy as np  # lazily, as in split_cells

    n = rec.p1 - rec.p0
    with (rec.file or path).open("rb") as fh:
        fh.seek(rec.offset + HEADER_SIZE)
        data = fh.read(4 * n)
    if len(data) != 4 * n:
        raise StateFileError("state file changed while reading")
    out: list[int] = np.frombuffer(data, dtype="<i4").tolist()
    return out


def split_cells(payload: bytes | memoryview, n_tokens: int) -> tuple[list[int], Any]:
    """Token ids and cell bytes of a CELLS payload; the cell bytes are a slice of the same kind (a
    memoryview payload gives a view: no copy)."""
    import numpy as np  # lazily: commands that only read headers must not load numpy

    tok: list[int] = np.frombuffer(payload, dtype="<i4", count=n_tokens).tolist()
    return tok, payload[4 * n_tokens:]


def header_payload(identity: dict[str, Any], *, based: bool = False) -> bytes:
    """The header's JSON: format 2 only for a file with a BASE record (older chatclis must refuse it),
    format 1 otherwise, so that every chatcli version keeps reading plain files."""
    fmt = BASE_FORMAT if based else PLAIN_FORMAT
    return json.dumps({"format": fmt, "identity": identity}, sort_keys=True).encode()


def base_name(path: Path) -> str:
    """A fresh name for a base file of the state file ``path`` (random: nested bases never collide)."""
    return f"{path.stem}.base-{secrets.token_hex(8)}.kv"


def base_files(path: Path) -> list[Path]:
    """The base files present next to the state file ``path`` (referenced or left over)."""
    return sorted(path.parent.glob(f"{path.stem}.base-*.kv"))


def base_payload(name: str, length: int, header_crc: int, last_offset: int, last_crc: int) -> bytes:
    return json.dumps({"file": name, "length": length, "header_crc": header_crc, "last_offset": last_offset,
                       "last_crc": last_crc}, sort_keys=True).encode()


def stored_crc(path: Path, rec: Record) -> int:
    """The crc a record's header stores (read, not computed: the record's crc was checked by the scan)."""
    with path.open("rb") as fh:
        fh.seek(rec.offset + HEADER_SIZE - 4)
        data = fh.read(4)
    if len(data) != 4:
        raise StateFileError("state file changed while reading")
    return int(struct.unpack("<I", data)[0])


class StateWriter:
    """Appends records to a state file; each append is written whole (or not at all) and, unless
    ``sync=False``, fsynced before it counts."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, records: Sequence[Raw], *, sync: bool = True) -> int:
        # One writev of every part; a failed append leaves no partial record behind.
        append_durably(self.path, [p for r in records for p in raw_parts(r)], sync=sync)
        return sum(len(r) for r in records)

    def cut(self, valid_bytes: int) -> None:
        """Drop a torn tail so that later appends follow a valid record."""
        with self.path.open("r+b") as fh:
            fh.truncate(valid_bytes)
            fh.flush()
            os.fsync(fh.fileno())

    def rewrite(self, records: Sequence[Raw]) -> int:
        """Replace the file by ``records`` (self-contained: no BASE record); its base links go."""
        parts = [p for r in records for p in raw_parts(r)]
        atomic_write_with(self.path, lambda fd: write_all(fd, parts))
        drop_bases(self.path)
        return sum(len(r) for r in records)


def drop_bases(path: Path, keep: Sequence[str] = ()) -> None:
    """Remove the base links of ``path`` it no longer refers to (all of them after a rewrite made it whole;
    those not named in ``keep`` when a restore finds links left by a crash between a rewrite and this).
    A parent or sibling sharing the inode keeps its own link; a left-over one is only wasted space."""
    for base in base_files(path):
        if base.name in keep:
            continue
        try:
            base.unlink()
        except OSError:
            pass


__all__ = [
    "BASE",
    "BASE_FORMAT",
    "CELLS",
    "FORMAT_VERSION",
    "HEADER",
    "HEADER_SIZE",
    "HISTORY",
    "KIND_NAMES",
    "LOGITS",
    "MAGIC",
    "MAX_BASE_DEPTH",
    "NOT_A_POINT",
    "PLAIN_FORMAT",
    "REVIVE",
    "REVIVED_KINDS",
    "REVIVES",
    "REVIVE_LOGITS",
    "SNAPSHOT",
    "SPARE",
    "TRUNCATE",
    "Buffer",
    "LiveChunk",
    "MappedState",
    "Raw",
    "Record",
    "RecordParts",
    "ScanResult",
    "StateFileError",
    "StateWriter",
    "base_files",
    "base_name",
    "base_payload",
    "cells_parts",
    "cells_payload",
    "check_format",
    "drop_bases",
    "encode_record",
    "encode_record_parts",
    "header_payload",
    "history_digest",
    "history_record",
    "live_kind",
    "map_state",
    "raw_bytes",
    "raw_parts",
    "read_payload",
    "read_tokens",
    "record_size_for_cells",
    "records_at",
    "revive_payload",
    "revive_target",
    "revived",
    "scan",
    "split_cells",
    "stored_crc",
]
