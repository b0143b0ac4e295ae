"""Greedy sampling in numpy (``_sample_greedy``) picks exactly the token llama.cpp's greedy chain picks: the
same logit bias, the same repeat penalty over the same window, the first maximum, NaN handed to the chain.
On the real engine, with logits made to be hard (ties, -inf, NaN, penalties that reorder the top) and over a
whole generated reply."""

from __future__ import annotations

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
    plan = llamacpp._GreedyPlan.of(s, engine.n_vocab)
    assert plan is not None
    return engine._sample_greedy(plan, s, 0)


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
    elif kind == 4:  # all non-positive: the penalty multiplies
        x = -np.abs(x)
    return x


@pytest.mark.parametrize("repeat", [1.0, 1.1, 1.5])
def test_numpy_greedy_equals_the_chain_on_hard_logits(engine: Engine, repeat: float) -> None:
    rng = np.random.default_rng(7)
    engine.clear()
    engine.eval(engine.tokenize(PROMPT))
    window = engine.tokens[-64:]
    for i in range(200):
        bias = tuple((int(t), float(b)) for t, b in zip(rng.choice(engine.n_vocab, 3), rng.normal(0, 2, 3),
                                                             strict=True))
        if i % 3 == 0:
            bias += ((int(window[-1]), float("-inf")), (int(window[-1]), 1.0))  # duplicates add in order
        s = Sampling(temperature=0.0, repeat_penalty=repeat, repeat_last_n=64 if i % 4 else 8, logit_bias=bias)
        engine.set_logits(hard_logits(rng, engine.n_vocab, window))
        assert numpy_token(engine, s) == chain_token(engine, s), i


def test_a_nan_goes_to_the_chain(engine: Engine) -> None:
    engine.clear()
    engine.eval(engine.tokenize(PROMPT))
    x = np.zeros(engine.n_vocab, dtype=np.float32)
    x[5] = np.nan
    x[9] = 3.0
    engine.set_logits(x)
    s = Sampling(temperature=0.0, repeat_penalty=1.0)
    assert numpy_token(engine, s) == chain_token(engine, s) == 9


def test_a_whole_greedy_reply_is_the_chains(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Sampling(temperature=0.0, repeat_penalty=1.3, repeat_last_n=32, logit_bias=((13, -2.5), (30, 1.5)))
    prompt = engine.tokenize(PROMPT)

    def reply() -> list[int]:
        engine.clear()
        engine.eval(prompt)
        return [ev.token for ev in engine.generate(s, seed=1, max_tokens=64)]

    fast = reply()
    monkeypatch.setattr(llamacpp._GreedyPlan, "of", classmethod(lambda cls, s, n: None))
    assert fast == reply()
    assert len(set(fast)) > 5  # a reply, not one token repeated
