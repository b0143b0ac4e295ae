"""llama.cpp's sequence-state bytes (``llama_state_seq_get_data``) of a plain attention cache, re-cut in numpy
for the siblings' shared batch context (``llamacpp._SharedBatch``).

That context keeps a stream per sequence (``kv_unified`` off): each conversation's cells lie together in its
own stream instead of interleaved with the others' (reading a reply's 47 cells back out of a unified cache
cost 10-16 ms under the model's lock, one copy per run of its cells per transposed V row), and a batched
decode attends each sequence over its own cells only, not over every sequence's (bench/results/kv_streams.md:
-3 / -5 / -22 % per decode at 2 / 4 / 8 conversations of 250 cells; a round missing a sequence in the middle,
which llama.cpp decodes in two micro-batches, +14 % at 4 and -13 % at 8). Its state bytes name its stream
count, which a single-stream context refuses ("n_stream mismatch"), and llama.cpp copies no range of cells
between two streams. So a sequence is read whole and re-cut here:

    magic u32, seq id i32, n_stream u32, then per stream: cell count u32 and, when not empty,
    count x cell metadata (position i32, sequence count u32, [extension], sequence id i32: one, as a
    single sequence is written), v_trans u32, n_layer u32, per layer K type i32, row size u64, the rows;
    per layer with V: type i32, then (V not transposed) row size u64 and the rows, or (transposed)
    element size u32, n_embd_v_gqa u32 and per embedding row the cells' elements.

(llama-kv-cache.cpp: ``state_write``, ``state_write_meta``, ``state_write_data``.) Anything that does not
parse exactly, to its last byte, is refused (``SeqStateError``): llama.cpp is never handed a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chatcli.errors import ChatcliError

_HEAD = 12  # magic, seq id, n_stream
_META_SIZES = (12, 16, 20, 24, 28, 32)  # a cell's metadata: 12 bytes, more with an extension (M-RoPE)


class SeqStateError(ChatcliError):
    """Sequence-state bytes that do not have the layout this module reads (an engine failure: the bytes
    came from llama.cpp)."""


@dataclass
class _Block:
    """The one stream of a sequence's state that holds cells: where its bytes are in the buffer."""

    start: int  # its cell count
    end: int
    count: int


def _u32(buf: np.ndarray, at: int) -> int:
    if at + 4 > buf.size:
        raise SeqStateError("sequence state ends early")
    return int(buf[at:at + 4].view("<u4")[0])


def _block(buf: np.ndarray) -> tuple[int, _Block | None]:
    """The stream count and the block of the one stream with cells (None: none has any)."""
    n_stream = _u32(buf, 8)
    at = _HEAD
    for s in range(n_stream):
        count = _u32(buf, at)
        if count == 0:
            at += 4
            continue
        # The rest of the buffer is this block and the empty streams after it (a zero count each).
        end = buf.size - 4 * (n_stream - 1 - s)
        if end <= at or np.any(buf[end:]):
            raise SeqStateError("cells in more than one stream")
        return n_stream, _Block(at, end, count)
    if at != buf.size:
        raise SeqStateError("trailing bytes after the streams")
    return n_stream, None


def widen(buf: np.ndarray, n_stream: int) -> np.ndarray:
    """A one-stream context's sequence state followed by ``4 * (n_stream - 1)`` spare bytes, made in place
    into the same state for a context of ``n_stream`` streams (its block of cells first, the other streams
    empty): what ``llama_state_seq_set_data`` of such a context reads into any sequence. No copy: the batch
    context's entry copies a whole conversation under the model's lock already."""
    spare = 4 * (n_stream - 1)
    if buf.size < _HEAD + spare or _u32(buf, 8) != 1:
        raise SeqStateError("not a one-stream sequence state with room for the other streams")
    buf[8:12] = np.frombuffer(np.uint32(n_stream).tobytes(), dtype=np.uint8)
    buf[buf.size - spare:] = 0
    _block(buf)  # the layout it now claims, checked
    return buf


class _Layout:
    """Where each part of a block is: cell metadata, then per layer the K rows and the V parts."""

    def __init__(self, buf: np.ndarray, block: _Block) -> None:
        self.count = c = block.count
        start = block.start + 4
        last: SeqStateError | None = None
        for meta in _META_SIZES:
            try:
                self._parse(buf, start, meta, block.end)
            except SeqStateError as exc:
                last = exc
                continue
            self.meta = meta
            self.meta_at = start
            positions = buf[start:start + c * meta].reshape(c, meta)[:, :4].copy().view("<i4")[:, 0]
            self.positions = positions
            return
        raise SeqStateError(f"the cells' layout is not one this version reads ({last})")

    def _parse(self, buf: np.ndarray, start: int, meta: int, end: int) -> None:
        c = self.count
        at = start + c * meta
        v_trans, n_layer = _u32(buf, at), _u32(buf, at + 4)
        if v_trans > 1 or not 0 < n_layer < 10_000:
            raise SeqStateError("not a cache's layout")
        at += 8
        self.k: list[tuple[int, int]] = []  # (offset of the rows, row size)
        for _ in range(n_layer):
            row = int(buf[at + 4:at + 12].view("<u8")[0]) if at + 12 <= end else -1
            if row <= 0 or at + 12 + c * row > end:
                raise SeqStateError("K rows past the end")
            self.k.append((at, row))
            at += 12 + c * row
        self.v: list[tuple[int, int, int]] = []  # (offset of the part, element or row size, embedding rows)
        self.v_trans = bool(v_trans)
        while at < end:
            if v_trans:
                el, n_embd = _u32(buf, at + 4), _u32(buf, at + 8)
                size = 12 + n_embd * c * el
                if el <= 0 or n_embd <= 0 or at + size > end:
                    raise SeqStateError("V elements past the end")
                self.v.append((at, el, n_embd))
            else:
                row = int(buf[at + 4:at + 12].view("<u8")[0]) if at + 12 <= end else -1
                size = 12 + c * row
                if row <= 0 or at + size > end:
                    raise SeqStateError("V rows past the end")
                self.v.append((at, row, 1))
            at += size
        if at != end or len(self.v) > n_layer:
            raise SeqStateError("the block does not end where its parts do")


def cut(data: bytes | bytearray | memoryview | np.ndarray, p0: int, p1: int) -> np.ndarray:
    """The sequence state of only the cells of positions [p0, p1) (in position order), for a context of one
    stream: what ``llama_state_seq_get_data`` of such a context gives for that range."""
    buf = np.frombuffer(data, dtype=np.uint8)
    _, block = _block(buf)
    if block is None:
        raise SeqStateError("no cells")
    lay = _Layout(buf, block)
    c = lay.count
    pos = lay.positions
    idx = np.flatnonzero((pos >= p0) & (pos < p1))
    idx = idx[np.argsort(pos[idx], kind="stable")]
    if idx.size != p1 - p0:
        raise SeqStateError(f"the sequence holds {idx.size} of the cells {p0}..{p1}")
    n = idx.size
    head = buf[:_HEAD].copy()
    head[8:12] = np.frombuffer(np.uint32(1).tobytes(), dtype=np.uint8)  # one stream
    parts = [head, np.frombuffer(np.uint32(n).tobytes(), dtype=np.uint8),
             buf[lay.meta_at:lay.meta_at + c * lay.meta].reshape(c, lay.meta)[idx].reshape(-1)]
    data_at = lay.meta_at + c * lay.meta
    parts.append(buf[data_at:data_at + 8])  # v_trans, n_layer
    for at, row in lay.k:
        parts.append(buf[at:at + 12])
        parts.append(buf[at + 12:at + 12 + c * row].reshape(c, row)[idx].reshape(-1))
    for at, size, n_embd in lay.v:
        parts.append(buf[at:at + 12])
        if lay.v_trans:
            parts.append(buf[at + 12:at + 12 + n_embd * c * size].reshape(n_embd, c, size)[:, idx].reshape(-1))
        else:
            parts.append(buf[at + 12:at + 12 + c * size].reshape(c, size)[idx].reshape(-1))
    return np.concatenate(parts)
