"""The logit bias and repeat penalty applied in numpy (``_LogitPlan``) give exactly the token llama.cpp's
chain gives: greedy (the first maximum, NaN handed to the chain) and seeded sampling (the rest of the chain on
the candidates numpy made). On the real engine, with logits made to be hard (ties, -inf, NaN, penalties that
reorder the top) and over whole generated replies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from chatcli.backends import llamacpp
from chatcli.backends.llamacpp import Engine, Sampling

PROMPT = "<|im_start|>user\nWrite a short poem about rain, with many repeated words.<|im_end|>\n<|im_start|>assistant\n"


def chain_token(engine: Engine, s: Sampling) -> int:
    chain = engine._make_sampler(s, 0)
    try:
        return engine._sample(chain)
    finally:
        llama_cpp.llama_sampler_free(chain)


def numpy_token(engine: Engine, s: Sampling) -> int:
    plan = llamacpp._LogitPlan.of(s, engine.n_vocab)
    assert plan is not None
    if plan.greedy:
        return engine._sample_greedy(plan, s, 0)
    rest = engine._make_sampler(s, 0, pre_applied=True)
    try:
        return engine._sample_candidates(rest, plan.apply(engine._current_logits(), engine.tokens))
    finally:
        llama_cpp.llama_sampler_free(rest)


def hard_logits(rng: np.random.Generator, n: int, window: list[int]) -> np.ndarray:
    x = rng.normal(0, 3, n).astype(np.float32)
    kind = rng.integers(0, 5)
    top = float(x.max())
    if kind == 1:  # ties: the first maximum wins
        x[rng.choice(n, 3, replace=False)] = top + 1
    elif kind == 2:  # the window's tokens at the top, positive and negative: the penalty reorders them
        x[window[:4]] = top + np.array([0.5, 0.4, -0.1, 0.2], dtype=np.float32)[: len(window[:4])]
    elif kind == 3:
        x[rng.choice(n, 100, replace=False)] = -np.inf
    elif kind == 4:  # all negative, the window's tokens on top: the penalty multiplies, and that decides
        x = -np.abs(x) - 1
        x[window[:3]] = np.array([-0.5, -0.6, -0.55], dtype=np.float32)[: len(window[:3])]
        x[rng.integers(0, n)] = -0.53
    return x


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("repeat", [1.0, 1.1, 1.5])
def test_numpy_bias_and_penalty_equal_the_chain_on_hard_logits(engine: Engine, repeat: float,
                                                                temperature: float) -> None:
    rng = np.random.default_rng(7)
    engine.clear()
    engine.eval(engine.tokenize(PROMPT))
    window = engine.tokens[-64:]
    for i in range(200):
        bias = tuple((int(t), float(b)) for t, b in zip(rng.choice(engine.n_vocab, 3), rng.normal(0, 2, 3),
                                                             strict=True))
        if i % 3 == 0:
            bias += ((int(window[-1]), float("-inf")), (int(window[-1]), 1.0))  # duplicates add in order
        s = Sampling(temperature=temperature, top_k=(0, 40)[i % 2], top_p=(1.0, 0.9)[i % 3 == 1], min_p=0.05 * (i % 2),
                     repeat_penalty=repeat, repeat_last_n=64 if i % 4 else 8, logit_bias=bias)
        engine.set_logits(hard_logits(rng, engine.n_vocab, window))
        assert numpy_token(engine, s) == chain_token(engine, s), i


@pytest.mark.parametrize("repeat", [1.1, 1.5, 0.7])
def test_greedy_penalty_without_bias_equals_the_chain_whether_the_maximum_is_recent_or_not(
        engine: Engine, repeat: float) -> None:
    """Without a bias, a penalty of 1 or more only lowers the window's values: the first maximum is taken as it is
    unless it is a recent token (``greedy_pick``). Both cases, ties and all-negative logits included, give the
    chain's token; a penalty under 1 (which raises them) always goes the whole way."""
    rng = np.random.default_rng(11)
    engine.clear()
    engine.eval(engine.tokenize(PROMPT))
    recent = {True: 0, False: 0}
    for i in range(240):
        last_n = 64 if i % 4 else 8
        window = engine.tokens[-last_n:]
        x = hard_logits(rng, engine.n_vocab, window)
        if i % 3 == 0:
            x[window[i % len(window)]] = float(x.max()) + 0.25  # the maximum is a recent token
        s = Sampling(temperature=0.0, repeat_penalty=repeat, repeat_last_n=last_n)
        engine.set_logits(x)
        recent[int(np.argmax(x)) in window] += 1
        assert numpy_token(engine, s) == chain_token(engine, s), i
        assert np.array_equal(engine._current_logits(), x)  # as computed, whichever way it went
    assert recent[True] > 20 and recent[False] > 20


@pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")  # the +inf meeting -inf
@pytest.mark.parametrize("repeat", [1.0, 1.1, 0.7])
def test_greedy_with_bans_equals_the_chain_whether_the_maximum_is_banned_or_not(engine: Engine, repeat: float) -> None:
    """Biases of 0 or less (a ban's -inf, a push down) only lower what they touch, as a penalty of 1 or more does:
    the first maximum stands unless it is touched. Banned, recent and new maxima, a +inf maximum that a ban
    turns into NaN, and a positive bias (the whole way) all give the chain's token."""
    rng = np.random.default_rng(5)
    engine.clear()
    engine.eval(engine.tokenize(PROMPT))
    window = engine.tokens[-64:]
    seen = {"banned": 0, "recent": 0, "new": 0}
    for i in range(240):
        x = hard_logits(rng, engine.n_vocab, window)
        banned = [int(t) for t in rng.choice(engine.n_vocab, 3)]
        if i % 4 == 0:
            x[banned[0]] = float(x.max()) + 0.5  # the maximum is banned
        elif i % 4 == 1:
            x[window[i % len(window)]] = float(x.max()) + 0.5  # the maximum is a recent token
        if i % 40 == 7:
            x[banned[1]] = np.inf  # +inf meets -inf: NaN, so the chain decides
        bias = [(banned[0], float("-inf")), (banned[1], float("-inf")), (banned[2], -3.0)]
        if i % 10 == 9:
            bias.append((int(rng.integers(0, engine.n_vocab)), 2.0))  # a raise: not a lowering plan
        s = Sampling(temperature=0.0, repeat_penalty=repeat, repeat_last_n=64, logit_bias=tuple(bias))
        engine.set_logits(x)
        top = int(np.argmax(x))
        seen["banned" if top in banned else "recent" if top in window else "new"] += 1
        assert numpy_token(engine, s) == chain_token(engine, s), i
        assert np.array_equal(engine._current_logits(), x, equal_nan=True)
    assert min(seen.values()) > 20, seen


@pytest.mark.parametrize(("repeat", "bias"), [(r, b) for r in (1.1, 0.7, 1.0) for b in ("none", "unique", "repeated")
                                               if (r, b) != (1.0, "none")])  # that one has no plan
def test_greedy_bias_and_penalty_leave_the_logits_as_computed(engine: Engine, repeat: float, bias: str) -> None:
    # Greedy's bias and penalty are written into the logits for the argmax and taken out again: the token is
    # the chain's, and the context's buffer and kept logits hold exactly what was computed, for the next
    # sample and for the LOGITS record a turn saves.
    rng = np.random.default_rng(11)
    engine.clear()
    engine.eval(engine.tokenize(PROMPT))
    window = engine.tokens[-64:]
    biases = {"none": (), "unique": ((int(window[-1]), -3.0), (17, 2.5)),
              "repeated": ((int(window[-1]), float("-inf")), (int(window[-1]), 1.0), (int(window[-2]), 4.0))}[bias]
    s = Sampling(temperature=0.0, repeat_penalty=repeat, repeat_last_n=64, logit_bias=biases)
    plan = llamacpp._LogitPlan.of(s, engine.n_vocab)
    assert plan is not None and plan.bias_unique == (bias != "repeated")
    computed = engine.logits()  # a copy of the context's buffer
    assert engine._logits is None and engine._ctx_logits  # sampled from the buffer in place
    assert numpy_token(engine, s) == chain_token(engine, s)
    assert engine.logits().tobytes() == computed.tobytes()
    for i in range(50):
        kept = hard_logits(rng, engine.n_vocab, window)
        engine.set_logits(kept)
        assert numpy_token(engine, s) == chain_token(engine, s), i
        assert engine.logits().tobytes() == kept.tobytes(), i


def test_a_nan_goes_to_the_chain(engine: Engine) -> None:
    engine.clear()
    engine.eval(engine.tokenize(PROMPT))
    x = np.zeros(engine.n_vocab, dtype=np.float32)
    x[5] = np.nan
    x[9] = 3.0
    engine.set_logits(x)
    s = Sampling(temperature=0.0, repeat_penalty=1.0)
    assert numpy_token(engine, s) == chain_token(engine, s) == 9


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_whole_reply_is_the_chains(engine: Engine, monkeypatch: pytest.MonkeyPatch, temperature: float) -> None:
    s = Sampling(temperature=temperature, repeat_penalty=1.3, repeat_last_n=32, logit_bias=((13, -2.5), (30, 1.5)))
    prompt = engine.tokenize(PROMPT)

    def reply() -> list[int]:
        engine.clear()
        engine.eval(prompt)
        return [ev.token for ev in engine.generate(s, seed=1, max_tokens=64)]

    fast = reply()
    monkeypatch.setattr(llamacpp._LogitPlan, "of", classmethod(lambda cls, s, n: None))
    assert fast == reply()
    assert len(set(fast)) > 5  # a reply, not one token repeated


_NO_IMPORTS = """
import sys
from chatcli.backends.llamacpp import Engine, Sampling
eng = Engine(sys.argv[1], n_ctx=512, n_threads=1)
eng.eval(eng.tokenize(sys.argv[2]))
before = set(sys.modules)
for t in (0.0, 0.8):
    for _ in eng.generate(Sampling(temperature=t, repeat_penalty=1.1), seed=1, max_tokens=8):
        pass
print(sorted(set(sys.modules) - before))
"""


def test_a_reply_imports_nothing_between_its_decodes(model_path: Path) -> None:
    """The token loop with the default repeat penalty loads no module on its first tokens (numpy 2's
    ``np.unique`` imported ``numpy.ma``, 15-20 ms between the first reply's first decodes). A fresh process:
    this one has imported everything already."""
    out = subprocess.run([sys.executable, "-c", _NO_IMPORTS, str(model_path), PROMPT], capture_output=True,
                         text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_plan_applied_in_the_contexts_buffer_samples_as_the_candidates_and_puts_it_back(engine: Engine) -> None:
    """Sampling with a bias and a penalty from the logits the last decode computed applies them in the context's
    buffer for llama.cpp's sampler (``_sample_planned``): the token is the one the numpy-filled candidates give
    with the same seed, and the buffer is as computed afterwards."""
    engine.clear()
    engine.eval(engine.tokenize(PROMPT))
    before = engine.logits()
    for seed in range(6):
        s = Sampling(temperature=0.8, top_k=(0, 40)[seed % 2], repeat_penalty=1.3, repeat_last_n=64,
                     logit_bias=((13, -2.5), (int(engine.tokens[-1]), 3.0)))
        plan = llamacpp._LogitPlan.of(s, engine.n_vocab)
        assert plan is not None and not plan.greedy
        picked = []
        for in_place in (True, False):
            chain = engine._make_sampler(s, seed, pre_applied=True)
            try:
                picked.append(engine._sample_planned(chain, plan) if in_place else
                              engine._sample_candidates(chain, plan.apply(engine._current_logits(), engine.tokens)))
            finally:
                llama_cpp.llama_sampler_free(chain)
            assert np.array_equal(engine._current_logits(), before)
        assert picked[0] == picked[1], seed
