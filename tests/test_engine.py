"""The engine on the real model: one context, only new tokens evaluated, determinism, cancellation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from chatcli.backends.llamacpp import Engine, GenerationResult, Sampling
from chatcli.core.template import ChatTemplate, Message

GREEDY = Sampling(temperature=0.0)


def _chat_turns(engine: Engine, template: ChatTemplate, texts: list[str]) -> tuple[list[int], list[int]]:
    """Run turns the way a conversation does; returns tokens evaluated per turn and new tokens per turn."""
    history = [Message("system", "You are a helpful assistant.")]
    engine.clear()
    engine.eval(engine.tokenize(template.prefix(history)))
    evaluated, new = [], []
    for text in texts:
        before = engine.n_evaluated_total
        glue = engine.tokenize(template.user_turn(history, text))
        engine.eval(glue)
        res = GenerationResult()
        pieces = b"".join(ev.piece for ev in engine.generate(GREEDY, seed=0, max_tokens=24, result=res))
        reply = pieces.decode("utf-8", "replace")
        history += [Message("user", text), Message("assistant", reply)]
        closing = template.closing(history)
        eog = engine.piece(res.tokens[-1]).decode() if res.stop_reason == "eog" else ""
        close_toks = engine.tokenize(closing[len(eog):] if eog and closing.startswith(eog) else closing)
        engine.eval(close_toks)
        evaluated.append(engine.n_evaluated_total - before)
        new.append(len(glue) + len(res.tokens) + len(close_toks))
    return evaluated, new


def test_each_turn_evaluates_only_its_new_tokens(engine: Engine, model_path) -> None:
    from chatcli.models.gguf import read_gguf

    template = ChatTemplate(read_gguf(model_path).chat_template)
    evaluated, new = _chat_turns(engine, template, ["Hi there!", "What is 2+2?", "Name a colour.", "Thanks."])
    assert evaluated == new
    assert all(n > 0 for n in new)
    # History is never re-read: the 4th turn costs about what the 1st did, not the sum of all before it.
    assert evaluated[3] < sum(evaluated[:3])


def test_incremental_logits_match_a_single_pass(engine: Engine, model_path) -> None:
    from chatcli.models.gguf import read_gguf

    template = ChatTemplate(read_gguf(model_path).chat_template)
    _chat_turns(engine, template, ["Hello!", "Tell me a fact.", "Another one."])
    engine.eval(engine.tokenize(template.user_turn([Message("system", "x")], "last")))
    incremental = engine.logits()
    tokens = list(engine.tokens)
    fresh = Engine(model_path, n_ctx=2048, n_threads=2)
    try:
        fresh.eval(tokens)
        whole = fresh.logits()
    finally:
        fresh.close()
    # Same tokens, different batch splits. Generated tokens were decoded one at a time, and llama.cpp's
    # single-token kernels round differently from its batched ones (measured: up to ~0.5 on logits of
    # ~25 for this Q4_1 model), so: close, same argmax, near-perfect correlation.
    assert np.abs(incremental - whole).max() < 1.5
    assert int(np.argmax(incremental)) == int(np.argmax(whole))
    assert np.corrcoef(incremental, whole)[0, 1] > 0.999


def test_replaying_the_same_batches_is_bit_identical(engine: Engine, model_path) -> None:
    """With the same batch boundaries a fresh context computes exactly the same logits: nothing from
    earlier turns leaks into the context beyond its tokens."""
    from chatcli.models.gguf import read_gguf

    template = ChatTemplate(read_gguf(model_path).chat_template)
    history = [Message("system", "Be brief.")]
    engine.clear()
    batches = [engine.tokenize(template.prefix(history)), engine.tokenize(template.user_turn(history, "Hi"))]
    for b in batches:
        engine.eval(b)
    res = GenerationResult()
    list(engine.generate(GREEDY, seed=0, max_tokens=10, result=res))
    batches += [[t] for t in res.tokens]
    follow = engine.tokenize("<|im_start|>user\nOk<|im_end|>\n<|im_start|>assistant\n")
    engine.eval(follow)
    fresh = Engine(model_path, n_ctx=2048, n_threads=2)
    try:
        for b in [*batches, follow]:
            fresh.eval(b)
        assert fresh.tokens == engine.tokens
        assert np.array_equal(fresh.logits(), engine.logits())
    finally:
        fresh.close()


def test_greedy_generation_is_deterministic(engine: Engine) -> None:
    outs = []
    for _ in range(2):
        engine.clear()
        engine.eval(engine.tokenize("<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n"))
        res = GenerationResult()
        list(engine.generate(GREEDY, seed=1, max_tokens=20, result=res))
        outs.append(res.tokens)
    assert outs[0] == outs[1] and len(outs[0]) > 3


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine: Engine) -> None:
    def run(seed: int) -> list[int]:
        engine.clear()
        engine.eval(engine.tokenize("<|im_start|>user\nWrite a poem.<|im_end|>\n<|im_start|>assistant\n"))
        res = GenerationResult()
        list(engine.generate(Sampling(temperature=1.0, top_k=0, top_p=1.0), seed=seed, max_tokens=20, result=res))
        return res.tokens

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


def test_cancel_mid_generation_keeps_a_consistent_context(engine: Engine, model_path) -> None:
    engine.clear()
    engine.eval(engine.tokenize("<|im_start|>user\nTell me a long story.<|im_end|>\n<|im_start|>assistant\n"))
    res = GenerationResult()
    seen = []
    for ev in engine.generate(GREEDY, seed=0, max_tokens=200, result=res):
        seen.append(ev.token)
        if len(seen) == 5:
            engine.cancel()  # what the REPL's Ctrl-C handler does
    assert res.stop_reason == "cancelled"
    assert res.tokens == seen == engine.tokens[-5:]
    # Every kept token has its cells: the KV ends exactly at the token list's end.
    assert engine.seq_pos_max() == engine.n_past - 1
    # And continuing from here equals a fresh evaluation of the same tokens.
    follow = engine.tokenize("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")
    engine.eval(follow)
    fresh = Engine(model_path, n_ctx=2048, n_threads=2)
    try:
        fresh.eval(list(engine.tokens))
        assert int(np.argmax(fresh.logits())) == int(np.argmax(engine.logits()))
    finally:
        fresh.close()


def test_closing_the_generator_early_keeps_shown_tokens(engine: Engine) -> None:
    engine.clear()
    engine.eval(engine.tokenize("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"))
    n0 = engine.n_past
    res = GenerationResult()
    gen = engine.generate(GREEDY, seed=0, max_tokens=50, result=res)
    first = next(gen)
    gen.close()
    assert engine.tokens[n0:] == [first.token] == res.tokens
    assert engine.seq_pos_max() == engine.n_past - 1


def test_sampling_from_saved_logits_matches_the_contexts_own(engine: Engine) -> None:
    """Tokens sampled by llama.cpp from the context's logits (the normal path) equal those sampled from
    saved logits (the path after a rollback or restore): same seed, same state, same tokens."""
    sampling = Sampling(temperature=0.9, top_k=40, top_p=0.95, repeat_penalty=1.1)
    engine.clear()
    engine.eval(engine.tokenize("<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"))
    n0, saved = engine.n_past, engine.logits()
    res_ctx = GenerationResult()
    list(engine.generate(sampling, seed=11, max_tokens=16, result=res_ctx))
    engine.truncate(n0)
    assert not engine.has_logits
    engine.set_logits(saved)  # first token from the saved logits, the rest from the context's
    res_saved = GenerationResult()
    list(engine.generate(sampling, seed=11, max_tokens=16, result=res_saved))
    assert res_ctx.tokens == res_saved.tokens and len(res_ctx.tokens) > 3
    # Every token through the saved-logits path: re-install the context's logits as saved ones each step.
    engine.truncate(n0)
    engine.set_logits(saved)
    chain = engine._make_sampler(sampling, 11)
    try:
        toks = []
        for _ in res_ctx.tokens:
            tok = engine._sample(chain)
            toks.append(tok)
            engine._decode([tok], last_logits=True)
            engine.set_logits(engine.logits())
    finally:
        import llama_cpp

        llama_cpp.llama_sampler_free(chain)
    assert toks == res_ctx.tokens


def test_the_load_lets_its_log_callbacks_in_quickly_and_restores_the_switch_interval(model_path, tmp_path) -> None:
    """llama.cpp calls into Python for each of its ~2,000 load log lines; with another thread running Python
    each waited up to the switch interval (5 ms) for the GIL. While it loads the interval is short; after,
    it is the one before (also when a load fails)."""
    import sys
    import threading

    import pytest

    from chatcli.backends.llamacpp import BackendError

    before = sys.getswitchinterval()
    during: list[float] = []
    stop = threading.Event()

    def busy() -> None:  # the other thread, as `serve`'s imports or the REPL's warm-up are
        while not stop.is_set():
            sum(range(1000))

    other = threading.Thread(target=busy)
    other.start()
    try:
        Engine(model_path, n_ctx=256, progress=lambda _: during.append(sys.getswitchinterval())).close()
    finally:
        stop.set()
        other.join()
    assert during and max(during) <= 0.0001 < before, (during, before)
    assert sys.getswitchinterval() == before
    bad = tmp_path / "unknown-arch.gguf"  # a header llama.cpp refuses: the load itself fails
    with model_path.open("rb") as fh:
        bad.write_bytes(fh.read(8 << 20).replace(b"llama", b"xxxxx", 1))
    with pytest.raises(BackendError, match="could not load the model"):
        Engine(bad, n_ctx=256)
    assert sys.getswitchinterval() == before



def test_kept_cells_belong_to_their_context_not_to_a_sibling_made_after(model_path) -> None:
    """``forget`` leaves the cells for the next evaluation of *this* context: a sibling made meanwhile (its
    own, empty KV cache) takes nothing up, and evaluates what it is given whole. Engines of its own: a
    sibling joins its engine to a shared batch context for good."""
    engine = Engine(model_path, n_ctx=512, n_threads=2)
    try:
        toks = engine.tokenize("The river runs past the old mill and the orchard.", add_special=True)
        engine.eval(toks)
        engine.forget()
        assert engine.kept(toks) == len(toks) - 2  # the cells are there, all but the last two taken up
        other = engine.sibling()
        try:
            assert other.kept(toks) == 0
            before = other.n_evaluated_total
            other.eval(toks)
            assert other.n_evaluated_total - before == len(toks) and other.tokens == toks
        finally:
            other.close()
    finally:
        engine.close()


def test_pieces_and_end_of_generation_are_llama_cpps_whether_asked_once_or_again(model_path: Path) -> None:
    """``piece`` and ``is_eog`` remember their answers (asked once per token of every reply): what they return,
    the first time and the next, is what llama.cpp says, with and without special tokens' text, for a
    sibling too (it shares the vocabulary and the memo)."""
    import llama_cpp

    with Engine(str(model_path), n_ctx=256) as eng:
        other = eng.sibling()
        try:
            ids = [*range(0, eng.n_vocab, 97), eng.eos_token, eng.bos_token]
            for _asked in range(2):
                for tok in ids:
                    for special in (False, True):
                        want = eng._piece(tok, special)
                        assert eng.piece(tok, special=special) == want
                        assert other.piece(tok, special=special) == want
                    assert eng.is_eog(tok) == other.is_eog(tok) == bool(llama_cpp.llama_vocab_is_eog(eng._vocab, tok))
            # A special token's text only with special=True: the memo keeps the two apart.
            assert eng.piece(eng.eos_token, special=False) == b""
            assert eng.piece(eng.eos_token, special=True) != b""
            assert eng.is_eog(eng.eos_token)
        finally:
            other.close()
