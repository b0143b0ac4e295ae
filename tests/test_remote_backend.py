"""The llama-server backend against a real llama-server process running the bundled SmolLM2.

One server for the module (loopback, free port, temporary --slot-save-path); tests that kill or restart
it leave it running again for the next. What is checked is what the server itself reports: its timings
(prompt tokens evaluated vs found in the slot), its slot save/restore counts, and the tokens it samples.
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatcli.backends.llama_server import (
    LlamaServerBackend,
    ServerConfig,
    ServerConnectionError,
    parse_server_url,
)
from chatcli.core.backend import (
    BackendError,
    ContextFullError,
    GenerationResult,
    Sampling,
)
from tests.remote_server import SKIP_REASON, LlamaServer, free_port, running_server, server_binary

pytestmark = pytest.mark.skipif(server_binary() is None, reason=SKIP_REASON)

GREEDY = Sampling(temperature=0.0, repeat_penalty=1.0)
N_CTX = 2048


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    yield from running_server(model_path, tmp_path_factory.mktemp("llama-server"), N_CTX)


@pytest.fixture
def backend(server: LlamaServer) -> Iterator[LlamaServerBackend]:
    if server.proc is None or server.proc.poll() is not None:
        server.start()  # a test before this one killed it
    b = LlamaServerBackend(ServerConfig(server.url, read_timeout=120))
    yield b
    b.close()


def chat_prompt(b: LlamaServerBackend, text: str) -> list[int]:
    return b.tokenize(f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
                      "<|im_start|>assistant\n")


def user_turn(b: LlamaServerBackend, text: str) -> list[int]:
    return b.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def reply(b: LlamaServerBackend, *, max_tokens: int = 24, seed: int = 7, sampling: Sampling = GREEDY) -> GenerationResult:
    res = GenerationResult()
    for _ in b.generate(sampling, seed=seed, max_tokens=max_tokens, result=res):
        pass
    return res


def evaluate(b: LlamaServerBackend, tokens: list[int]) -> None:
    for _ in b.eval_steps(tokens):
        pass


# -- vocabulary and identity --------------------------------------------------------------------------------


def test_vocabulary_and_identity_match_the_model_file(backend: LlamaServerBackend, engine: object) -> None:
    from chatcli.backends.llamacpp import Engine

    assert isinstance(engine, Engine)
    text = "Hello, wörld! <|im_start|>user\n  spaces\tand 日本語"
    assert backend.tokenize(text) == engine.tokenize(text)
    assert backend.tokenize(text, parse_special=False) == engine.tokenize(text, parse_special=False)
    assert backend.tokenize(text, add_special=True) == engine.tokenize(text, add_special=True)
    assert (backend.n_vocab, backend.bos_token, backend.eos_token, backend.add_bos) == (
        engine.n_vocab, engine.bos_token, engine.eos_token, engine.add_bos)
    toks = [*engine.tokenize(text), engine.eos_token]
    assert backend.pieces(toks) == [engine.piece(t) for t in toks]
    assert [backend.piece(t, special=False) for t in toks] == [engine.piece(t, special=False) for t in toks]
    assert backend.is_eog(engine.eos_token)
    ident = backend.identity()
    assert ident["n_ctx"] == N_CTX and ident["model"] == engine.model_path.rsplit("/", 1)[-1]
    assert ident["n_vocab"] == engine.n_vocab and ident["model_size"] > 0
    assert backend.caps.checkpoint and not (backend.caps.cells or backend.caps.logits or backend.caps.shift)
    assert not backend.caps.local_sampling
    assert backend.chat_template  # rendered locally by core/template.py


# -- what the server evaluates ------------------------------------------------------------------------------
# (Greedy tokens equal to the local engine's: tests/test_remote_sampling.py, whose server runs the local
# engine's attention. This module's server keeps llama-server's default, flash attention "auto", as users run it.)


def test_each_turn_evaluates_only_its_new_tokens(backend: LlamaServerBackend) -> None:
    backend.clear()
    prompt = chat_prompt(backend, "Tell me a fact about the sea." + " Please." * 3)
    n0 = backend.n_evaluated_total
    evaluate(backend, prompt)
    first = reply(backend)
    # the slot may still hold an earlier test's sequence: its common prefix (the system prompt) is reused
    assert first.n_prompt_evaluated is not None and first.n_prompt_cached is not None
    assert first.n_prompt_evaluated + first.n_prompt_cached == len(prompt)
    assert first.tokens and backend.tokens == prompt + first.tokens
    user = user_turn(backend, "And another one?")
    evaluate(backend, user)
    second = reply(backend)
    # Only the new message, plus the previous reply's last token (sampled but never decoded by the server).
    assert second.n_prompt_evaluated == len(user) + 1
    assert second.n_prompt_cached == len(prompt) + len(first.tokens) - 1
    # The Backend protocol's counter: what the server reported evaluating, prompts and generated tokens.
    assert backend.n_evaluated_total - n0 == (first.n_prompt_evaluated + len(first.tokens)
                                              + second.n_prompt_evaluated + len(second.tokens))


def test_rollback_evaluates_at_most_one_token_and_replays_greedy(backend: LlamaServerBackend) -> None:
    backend.clear()
    prompt = chat_prompt(backend, "What is two plus two?")
    evaluate(backend, prompt)
    first = reply(backend)
    dropped = backend.truncate(len(prompt))
    assert dropped == len(first.tokens) and backend.tokens == prompt
    again = reply(backend)
    # The whole prompt is in the slot: the server evaluates its last token again to get logits.
    assert again.n_prompt_evaluated == 1 and again.n_prompt_cached == len(prompt) - 1
    assert again.tokens == first.tokens


def test_large_evaluation_streams_progress(backend: LlamaServerBackend) -> None:
    backend.clear()
    prompt = chat_prompt(backend, " ".join(f"item {i}," for i in range(300)))
    assert len(prompt) > backend.n_batch
    steps = list(backend.eval_steps(prompt))
    assert len(steps) >= 2, steps
    assert steps[-1][0] == steps[-1][1]
    assert all(b[0] >= a[0] for a, b in itertools.pairwise(steps))
    res = reply(backend, max_tokens=4)
    # Reported with the reply: the eager evaluation plus the one token the reply re-evaluated.
    assert res.n_prompt_evaluated is not None and res.n_prompt_evaluated >= len(prompt) - 64
    assert res.n_prompt_cached == len(prompt) - 1


def test_sampling_is_reproducible_per_seed(backend: LlamaServerBackend) -> None:
    backend.clear()
    prompt = chat_prompt(backend, "Write a word.")
    hot = Sampling(temperature=1.0, top_k=40, top_p=0.95, repeat_penalty=1.1)
    evaluate(backend, prompt)
    runs = []
    for seed in (1, 1, 2):
        backend.truncate(len(prompt))
        runs.append(reply(backend, seed=seed, sampling=hot, max_tokens=16).tokens)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_cancel_keeps_delivered_tokens_and_the_next_request_works(backend: LlamaServerBackend) -> None:
    backend.clear()
    prompt = chat_prompt(backend, "Count from one to one hundred, in words.")
    evaluate(backend, prompt)
    res = GenerationResult()
    for i, _ev in enumerate(backend.generate(GREEDY, seed=1, max_tokens=200, result=res)):
        if i == 3:
            backend.cancel()
    assert res.stop_reason == "cancelled"
    assert 4 <= len(res.tokens) <= 6
    assert backend.tokens == prompt + res.tokens
    # The abandoned stream did not break the connection; the server trims what it decoded beyond ours.
    more = reply(backend, max_tokens=4)
    assert more.n_prompt_cached is not None and more.n_prompt_cached >= len(prompt)


def test_closing_the_generator_keeps_the_token_it_was_given(backend: LlamaServerBackend) -> None:
    backend.clear()
    prompt = chat_prompt(backend, "Say hello.")
    evaluate(backend, prompt)
    res = GenerationResult()
    gen = backend.generate(GREEDY, seed=1, max_tokens=50, result=res)
    first = next(gen)
    gen.close()
    assert res.tokens == [first.token] and res.stop_reason == "cancelled"
    assert backend.tokens == [*prompt, first.token]


def test_context_limits(backend: LlamaServerBackend) -> None:
    backend.clear()
    with pytest.raises(ContextFullError):
        list(backend.eval_steps([1] * (N_CTX + 1)))
    assert backend.tokens == []
    with pytest.raises(BackendError, match="vocabulary"):
        list(backend.eval_steps([backend.n_vocab + 5]))
    assert backend.tokens == []


# -- checkpoints --------------------------------------------------------------------------------------------


def test_checkpoint_survives_a_server_restart(server: LlamaServer, backend: LlamaServerBackend) -> None:
    backend.clear()
    prompt = chat_prompt(backend, "Remember the number 42.")
    evaluate(backend, prompt)
    reply(backend)
    evaluate(backend, backend.tokenize("\n"))  # the turn's closing tokens: pending until the checkpoint
    held = list(backend.tokens)
    written = backend.checkpoint("conv-restart")
    assert written > 0 and backend.stats.last_save["n_saved"] == len(held)
    path = server.slot_save_path / "conv-restart.bin"  # type: ignore[operator]
    assert path.is_file() and path.stat().st_size == written
    # The uninterrupted continuation, then back to the checkpoint.
    user = user_turn(backend, "What number?")
    evaluate(backend, user)
    uninterrupted = reply(backend)
    assert uninterrupted.n_prompt_evaluated == len(user)  # the checkpoint flushed the closing tokens
    backend.close()

    server.stop()
    server.start()
    fresh = LlamaServerBackend(ServerConfig(server.url))
    try:
        assert fresh.identity() == backend.identity()
        assert fresh.restore_checkpoint("conv-restart", held)
        assert fresh.tokens == held and fresh.stats.last_restore["n_restored"] == len(held)
        evaluate(fresh, user)
        resumed = reply(fresh)
        assert resumed.n_prompt_evaluated == len(user) and resumed.n_prompt_cached == len(held)
        assert resumed.tokens == uninterrupted.tokens
        # Wrong expectations are refused and change nothing here.
        assert not fresh.restore_checkpoint("conv-restart", held[:-1])
        assert not fresh.restore_checkpoint("no-such-conversation", held)
        with pytest.raises(BackendError, match="bad checkpoint name"):
            fresh.checkpoint("../escape")
    finally:
        fresh.close()


def test_slot_lost_between_turns_is_restored_from_the_checkpoint(server: LlamaServer, backend: LlamaServerBackend) -> None:
    """The server restarts on the same port while a conversation is open: the next reply notices that the
    slot lost its tokens, restores the last checkpoint, and pays only for the new message."""
    backend.clear()
    prompt = chat_prompt(backend, "Remember the colour blue." + " Really." * 20)
    evaluate(backend, prompt)
    reply(backend)
    assert backend.checkpoint("conv-lost") > 0
    port = server.port
    server.stop()
    server.start(port=port)
    user = user_turn(backend, "Which colour?")
    evaluate(backend, user)
    res = reply(backend)
    assert res.n_prompt_evaluated == len(user)
    assert backend.stats.last_restore["filename"] == "conv-lost.bin"


def test_server_killed_mid_reply(server: LlamaServer, backend: LlamaServerBackend) -> None:
    backend.clear()
    prompt = chat_prompt(backend, "Count from one to one hundred, in words.")
    evaluate(backend, prompt)
    res = GenerationResult()
    seen = []
    killer = threading.Thread(target=server.kill)
    with pytest.raises(ServerConnectionError) as err:
        for ev in backend.generate(GREEDY, seed=1, max_tokens=400, result=res):
            seen.append(ev.token)
            if len(seen) == 3:
                killer.start()
    # Until the killer has reaped the process, Popen.poll() answers None (another thread holds its waitpid
    # lock), and the next test's fixture would take the dead server for a live one.
    killer.join()
    msg = str(err.value)
    assert "\n" not in msg and server.url.split("//")[1] in msg
    assert res.tokens == seen and backend.tokens == prompt + seen  # what was delivered is kept
    assert res.stop_reason == "cancelled"
    with pytest.raises(ServerConnectionError, match="cannot reach"):
        backend.tokenize("still there?")


def test_unreachable_server_is_one_line() -> None:
    port = free_port()
    with pytest.raises(ServerConnectionError) as err:
        LlamaServerBackend(ServerConfig(f"http://127.0.0.1:{port}", connect_timeout=2))
    assert "cannot reach llama-server" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("url", ["ftp://host:1", "http://", "http://host:99999", "http://h:1/?q=1"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(BackendError, match="bad server URL"):
        parse_server_url(url)


def test_url_forms() -> None:
    assert parse_server_url("localhost:8080") == ("http", "localhost", 8080, "")
    assert parse_server_url("https://gpu.example/llama/") == ("https", "gpu.example", 443, "/llama")


def test_slot_files_are_the_servers(server: LlamaServer, backend: LlamaServerBackend) -> None:
    """Slot files are written by the server process with its own umask (the README says so; this pins it)."""
    backend.clear()
    evaluate(backend, chat_prompt(backend, "Hello."))
    assert backend.checkpoint("conv-mode") > 0
    path = server.slot_save_path / "conv-mode.bin"  # type: ignore[operator]
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
