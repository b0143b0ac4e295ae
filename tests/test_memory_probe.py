"""The engine's memory probe and its rewind, on llama.cpp's own fixture models of every memory kind.

`Engine._probe_memory` asks llama.cpp what the context's memory can do (truncate a tail; copy a position
range, tried in a forked child because DeepSeek-V4 asserts instead of refusing); `Engine.rewind` then
returns a memory that cannot be cut back to a saved point. These are the engine-level facts the state log
(core/kv/log.py) builds on: each is checked against a fresh evaluation of the same tokens, bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.archs import ArchFixtures

# architecture → the kind the probe must find (one or more of each kind llama.cpp has)
KINDS = {
    "llama": "attention", "gemma3": "swa", "gpt-oss": "swa", "deepseek2": "attention",
    "granitehybrid": "hybrid", "qwen35": "hybrid", "lfm2": "hybrid",
    "mamba": "recurrent", "mamba2": "recurrent",
    "deepseek4": "whole",
}
# Longer than the fixtures' sliding windows (32 tokens): a sliding-window cache saves only the window.
A = [(7 * i) % 100 + 3 for i in range(70)]
B = [(11 * i) % 100 + 5 for i in range(40)]
X = [17, 23, 29, 31, 37]


@pytest.mark.parametrize("arch", sorted(KINDS))
def test_probe_finds_the_memory_kind_and_rewind_equals_a_fresh_evaluation(arch_fixtures: ArchFixtures, arch: str) -> None:
    from chatcli.backends.llamacpp import Engine

    eng = Engine(arch_fixtures.path(arch), n_ctx=256, n_threads=2)
    try:
        caps = eng.caps
        assert caps.memory == KINDS[arch]
        assert caps.truncate == (KINDS[arch] in ("attention", "swa"))
        assert caps.ranges == (KINDS[arch] in ("attention", "swa", "hybrid"))
        assert not caps.shift or caps.truncate  # a memory that cannot be cut back never shifts
        assert eng.n_evaluated_total == 0 and eng.n_past == 0  # the probe leaves nothing behind
        # The record that ends at len(A), saved as the state log saves it (the sequence ends there).
        eng.eval(A)
        rec = eng.save_cells(0, len(A))
        eng.eval(B)
        if not caps.truncate:
            with pytest.raises(Exception, match="cannot be cut back"):
                eng.truncate(len(A))
            assert eng.n_past == len(A) + len(B)  # a refused truncation changed nothing
        eng.rewind(len(A), 0, rec)
        assert eng.tokens == A
        eng.eval(X)
        rewound = eng.logits()
        eng.clear()
        eng.eval(A)
        eng.eval(X)
        assert_same(arch, rewound, eng.logits())
    finally:
        eng.close()


def assert_same(arch: str, got: np.ndarray, want: np.ndarray) -> None:
    """Bit-identical, except on DeepSeek-V4: llama.cpp 0.3.36's DSV4 cache does not round-trip its state
    exactly once a sequence passes ~64 tokens (a whole-state save of 69 tokens loaded back into the same
    context, then 10 more evaluated: max |Δ logit| 2.9e-6; 30 tokens: exact) — its compressed rows, not
    anything chatcli does. There the logits must still agree to 1e-4."""
    if arch == "deepseek4":
        assert float(np.abs(got - want).max()) < 1e-4
    else:
        assert np.array_equal(got, want)


@pytest.mark.parametrize("arch", ["gemma3", "granitehybrid", "mamba"])
def test_cells_saved_in_ranges_restore_in_a_new_context(arch_fixtures: ArchFixtures, arch: str) -> None:
    """Resume's path: records loaded in order into another context continue bit-identically."""
    from chatcli.backends.llamacpp import Engine

    path = arch_fixtures.path(arch)
    eng = Engine(path, n_ctx=256, n_threads=2)
    other = Engine(path, n_ctx=256, n_threads=2)
    try:
        eng.eval(A)
        first = eng.save_cells(0, len(A))
        eng.eval(B)
        ranges = eng.caps.ranges
        second = eng.save_cells(len(A) if ranges else 0, len(A) + len(B))
        if not ranges:
            with pytest.raises(Exception, match="saved whole"):
                eng.save_cells(len(A), len(A) + len(B))
        if not eng.caps.truncate:
            with pytest.raises(Exception, match="only be saved where it ends"):
                eng.save_cells(0, len(A))  # the recurrent state of len(A) is gone
        eng.eval(X)
        if ranges:
            other.load_cells(0, len(A), first, A)
            other.load_cells(len(A), len(A) + len(B), second, B)
        else:
            other.load_cells(0, len(A) + len(B), second, A + B)
        other.eval(X)
        assert np.array_equal(eng.logits(), other.logits())
        # and a rollback into the restored history (regenerate after resume) equals a fresh evaluation
        other.rewind(len(A), 0, first)
        other.eval(X)
        rolled = other.logits()
        other.clear()
        other.eval(A)
        other.eval(X)
        assert np.array_equal(rolled, other.logits())
    finally:
        other.close()
        eng.close()


def test_without_fork_a_hybrid_memory_is_saved_whole_and_still_rewinds(arch_fixtures: ArchFixtures,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where os.fork does not exist (Windows) the range-copy probe cannot run safely: the engine then uses
    whole-sequence saves only, which every memory supports, and rollback still matches a fresh evaluation."""
    from chatcli.backends.llamacpp import Engine

    monkeypatch.delattr(os, "fork")
    eng = Engine(arch_fixtures.path("granitehybrid"), n_ctx=256, n_threads=2)
    try:
        assert eng.caps.memory == "whole" and not eng.caps.ranges
        eng.eval(A)
        rec = eng.save_cells(0, len(A))
        eng.eval(B)
        eng.rewind(len(A), 0, rec)
        eng.eval(X)
        rewound = eng.logits()
        eng.clear()
        eng.eval(A)
        eng.eval(X)
        assert np.array_equal(rewound, eng.logits())
    finally:
        eng.close()


def test_the_fork_probe_tells_an_abort_from_a_return() -> None:
    """The probe itself: a call that aborts the process (as a GGML_ASSERT does) is told apart from one that
    returns, and the parent survives both."""
    from chatcli.backends.llamacpp import _fork_probe

    assert _fork_probe(lambda: None) is True
    assert _fork_probe(os.abort) is False
    assert _fork_probe(lambda: 1 / 0) is False
