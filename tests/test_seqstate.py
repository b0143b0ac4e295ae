"""The batch context's sequence-state surgery (seqstate.py) on llama.cpp's real bytes: a range cut out of a
whole sequence is byte for byte what llama.cpp saves for that range, a state widened to another stream count
differs only in that count, and anything else is refused before llama.cpp sees it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from chatcli.backends import seqstate
from chatcli.backends.llamacpp import Engine


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    eng = Engine(model_path, n_ctx=512, n_threads=2)
    eng.eval(eng.tokenize("The river runs past the old mill and under the stone bridge. " * 6))
    yield eng
    eng.close()


def test_a_cut_is_what_llama_cpp_saves_for_the_range(engine: Engine) -> None:
    n = engine.n_past
    whole = bytes(engine.save_cells(0, n))
    for p0, p1 in [(0, n), (7, 40), (n - 1, n), (40, n)]:
        assert seqstate.cut(whole, p0, p1).tobytes() == bytes(engine.save_cells(p0, p1))


def test_a_widened_state_differs_only_in_its_stream_count(engine: Engine) -> None:
    n = engine.n_past
    whole = bytes(engine.save_cells(0, n))
    buf = np.concatenate([np.frombuffer(whole, dtype=np.uint8), np.full(12, 0xFF, dtype=np.uint8)])
    four = seqstate.widen(buf, 4)
    assert four is buf and four.size == len(whole) + 12  # in place; three empty streams: a zero count each
    assert four[8:12].view("<u4")[0] == 4 and not four[len(whole):].any()
    assert four[:8].tobytes() == whole[:8] and four[12:len(whole)].tobytes() == whole[12:]
    assert seqstate.cut(four, 3, 9).tobytes() == bytes(engine.save_cells(3, 9))


def test_what_does_not_parse_is_refused(engine: Engine) -> None:
    n = engine.n_past
    whole = np.frombuffer(bytes(engine.save_cells(0, n)), dtype=np.uint8)
    with pytest.raises(seqstate.SeqStateError):
        seqstate.cut(whole[:-1], 0, n)  # one byte short
    with pytest.raises(seqstate.SeqStateError):
        seqstate.cut(np.concatenate([whole, whole[:4]]), 0, n)  # trailing bytes
    with pytest.raises(seqstate.SeqStateError):
        seqstate.cut(whole, 0, n + 1)  # cells it does not hold
    two = whole.copy()
    two[8:12] = np.frombuffer(np.uint32(2).tobytes(), dtype=np.uint8)  # says two streams, one given
    with pytest.raises(seqstate.SeqStateError):
        seqstate.cut(np.concatenate([two, whole[12:]]), 0, n)  # both streams hold cells
    with pytest.raises(seqstate.SeqStateError):
        seqstate.widen(whole[:10].copy(), 2)  # too short
    with pytest.raises(seqstate.SeqStateError):
        seqstate.widen(np.concatenate([two, whole[12:], np.zeros(4, dtype=np.uint8)]), 2)  # not one stream


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_a_cut_of_an_untransposed_v_cache_is_what_llama_cpp_saves(model_path: Path, kv_type: str) -> None:
    # A quantized KV cache runs with flash attention, which stores V untransposed: the other V layout.
    eng = Engine(model_path, n_ctx=512, n_threads=2, kv_type=kv_type)
    try:
        eng.eval(eng.tokenize("The river runs past the old mill and under the stone bridge. " * 4))
        n = eng.n_past
        whole = bytes(eng.save_cells(0, n))
        assert whole[16 + 12 * n:20 + 12 * n] == b"\0\0\0\0"  # v_trans 0
        for p0, p1 in [(0, n), (5, 20), (n - 1, n)]:
            assert seqstate.cut(whole, p0, p1).tobytes() == bytes(eng.save_cells(p0, p1))
    finally:
        eng.close()
