"""The append-only KV state file (``state.kv``) of a conversation, and the persona prefix cache files.

A state file is a sequence of checksummed records::

    magic "CKV1" | kind u8 | reserved u8 u16 | p0 i32 | p1 i32 | length u64 | crc32 u32 | payload

- ``HEADER``   JSON: format version, model identity and context parameters the cells belong to.
- ``CELLS``    cells of positions [p0, p1): their token ids (int32 each) then llama.cpp's sequence-state
               bytes. One per turn, so a snapshot costs O(new tokens), not O(context).
- ``TRUNCATE`` the context was rolled back to p0 tokens.
- ``SNAPSHOT`` like CELLS from position 0: replaces everything before it (compaction, context shift).
- ``LOGITS``   float32 logits after position p0-1: lets /regen sample again without re-evaluating.

The crc covers the header fields and the payload, so a torn or bit-flipped record is detected; reading
stops at the first bad record and the rest is treated as missing (re-evaluated from the transcript).
The file is a cache: the transcript is the truth, and deleting this file only costs a re-evaluation.

Versions (the rule is in migrations.py): the header's ``format`` is the file's major version; a newer one
is refused, never rebuilt over. A record of a kind this version does not know, but whose framing and crc
are sound, was added by a newer chatcli under the same major version: it is skipped, not taken for damage.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from chatcli.core import migrations
from chatcli.core.fsutil import append_durably, atomic_write_bytes

MAGIC = b"CKV1"
FORMAT_VERSION = migrations.STATE_VERSION
_HDR = struct.Struct("<4sBBHiiQI")  # magic kind flags reserved p0 p1 length crc
HEADER_SIZE = _HDR.size

HEADER, CELLS, TRUNCATE, SNAPSHOT, LOGITS = 1, 2, 3, 4, 5
KIND_NAMES = {HEADER: "header", CELLS: "cells", TRUNCATE: "truncate", SNAPSHOT: "snapshot", LOGITS: "logits"}
_MAX_PAYLOAD = 1 << 36


class StateFileError(ValueError):
    """The state file is unusable as a whole (foreign, wrong version, other model)."""


@dataclass
class Record:
    kind: int
    p0: int
    p1: int
    offset: int  # of the record header in the file
    length: int  # payload bytes

    @property
    def size(self) -> int:
        return HEADER_SIZE + self.length


def encode_record(kind: int, p0: int, p1: int, payload: bytes) -> bytes:
    head = struct.pack("<4sBBHiiQ", MAGIC, kind, 0, 0, p0, p1, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head + struct.pack("<I", crc) + payload


def records_at(raws: list[bytes], offset: int) -> tuple[list[Record], int]:
    """Index encoded records written at ``offset``: their headers, and the offset after the last one."""
    out = []
    for raw in raws:
        _, kind, _, _, p0, p1, length, _ = _HDR.unpack_from(raw, 0)
        out.append(Record(kind, p0, p1, offset, length))
        offset += len(raw)
    return out, offset


def cells_payload(tokens: list[int], kv: bytes) -> bytes:
    import numpy as np  # here, not at the top: `chatcli ls` reads headers and must not load numpy

    return np.asarray(tokens, dtype="<i4").tobytes() + kv


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

    def live(self) -> tuple[list[LiveChunk], Record | None, int]:
        """Replay the records: the live chunks, the live logits record, and the state's length."""
        chunks: list[LiveChunk] = []
        logits: Record | None = None
        n = 0
        for rec in self.records:
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

    def live_bytes(self) -> int:
        chunks, logits, _ = self.live()
        total = sum(c.record.size for c in chunks) + (logits.size if logits else 0)
        if self.records and self.records[0].kind == HEADER:
            total += self.records[0].size
        return total


def scan(path: Path) -> ScanResult:
    """Read record headers (payloads are checked by crc, not kept in memory)."""
    try:
        check_format(path)
    except migrations.FormatError as exc:
        return ScanResult(header=None, problem=str(exc), newer_format=True, dropped_bytes=0)
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return ScanResult(header=None, problem="missing")
    with fh:
        size = os.fstat(fh.fileno()).st_size
        res = ScanResult(header=None)
        offset = 0
        n = 0  # the state's length so far, to check that every CELLS record continues it
        while offset < size:
            rec, payload, problem = _read_record(fh, offset, size)
            if rec is None:
                res.problem = problem
                break
            if offset == 0:
                if rec.kind != HEADER:
                    res.problem = "not a chatcli state file"
                    break
                try:
                    header = json.loads(payload)
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
            elif rec.kind == CELLS and rec.p0 != n:
                # Well-formed but not continuing the state (a writer bug, or records spliced from elsewhere):
                # it and everything after it count as damaged, so the writer cuts them instead of appending
                # new records behind one that makes every later reader stop.
                res.problem = f"record at {offset} does not continue the state ({rec.p0} != {n})"
                break
            if rec.kind in (CELLS, SNAPSHOT):
                n = rec.p1
            elif rec.kind == TRUNCATE:
                n = min(n, rec.p0)
            res.records.append(rec)
            offset += rec.size
        res.valid_bytes = offset if res.header is not None else 0
        res.dropped_bytes = size - res.valid_bytes
        if res.header is None and not res.problem:
            res.problem = "empty"
        return res


def _read_record(fh: BinaryIO, offset: int, size: int) -> tuple[Record | None, bytes, str]:
    if offset + HEADER_SIZE > size:
        return None, b"", "truncated record header"
    fh.seek(offset)
    head = fh.read(HEADER_SIZE)
    magic, kind, _flags, _res, p0, p1, length, crc = _HDR.unpack(head)
    if magic != MAGIC:
        return None, b"", "bad magic" if offset else "not a chatcli state file"
    # An unknown kind is a record of a newer chatcli (same major version): the framing rules still hold.
    if length > _MAX_PAYLOAD or (kind in KIND_NAMES and (p0 < 0 or p1 < p0)):
        return None, b"", "bad record header"
    if offset + HEADER_SIZE + length > size:
        return None, b"", "truncated record"
    # Check the crc streaming, so a multi-GB snapshot is not held twice in memory.
    c = zlib.crc32(head[:-4])
    keep = kind in (HEADER,)
    kept = bytearray()
    remaining = length
    while remaining:
        part = fh.read(min(remaining, 1 << 22))
        if not part:
            return None, b"", "truncated record"
        c = zlib.crc32(part, c)
        if keep:
            kept += part
        remaining -= len(part)
    if c != crc:
        return None, b"", "checksum mismatch"
    return Record(kind, p0, p1, offset, length), bytes(kept), ""


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
    with path.open("rb") as fh:
        fh.seek(rec.offset)
        data = fh.read(rec.size)
    if len(data) != rec.size:
        raise StateFileError("state file changed while reading")
    head = data[:HEADER_SIZE]
    crc = _HDR.unpack(head)[-1]
    if zlib.crc32(data[HEADER_SIZE:], zlib.crc32(head[:-4])) != crc:
        raise StateFileError("checksum mismatch")
    return data[HEADER_SIZE:]


def split_cells(payload: bytes, n_tokens: int) -> tuple[list[int], bytes]:
    import numpy as np

    tok = np.frombuffer(payload[: 4 * n_tokens], dtype="<i4").astype(np.int64).tolist()
    return tok, payload[4 * n_tokens:]


def header_payload(identity: dict[str, Any]) -> bytes:
    return json.dumps({"format": FORMAT_VERSION, "identity": identity}, sort_keys=True).encode()


class StateWriter:
    """Appends records to a state file; each append is flushed and fsynced before it counts."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, records: list[bytes]) -> int:
        data = b"".join(records)
        append_durably(self.path, data)  # a failed append leaves no partial record behind
        return len(data)

    def cut(self, valid_bytes: int) -> None:
        """Drop a torn tail so that later appends follow a valid record."""
        with self.path.open("r+b") as fh:
            fh.truncate(valid_bytes)
            fh.flush()
            os.fsync(fh.fileno())

    def rewrite(self, records: list[bytes]) -> int:
        data = b"".join(records)
        atomic_write_bytes(self.path, data)
        return len(data)


__all__ = [
    "CELLS",
    "HEADER",
    "LOGITS",
    "SNAPSHOT",
    "TRUNCATE",
    "LiveChunk",
    "Record",
    "ScanResult",
    "StateFileError",
    "StateWriter",
    "cells_payload",
    "check_format",
    "encode_record",
    "header_payload",
    "read_payload",
    "record_size_for_cells",
    "records_at",
    "scan",
    "split_cells",
]
