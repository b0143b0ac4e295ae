"""The remote backend sends every sampling field (a real llama-server, the bundled model, compared with the
local engine): logit bias, min_p, presence and frequency penalties and grammars sample on the server as
they do here; a grammar the server refuses is one ``GrammarError``; ``serve --server`` honours
response_format."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatcli.backends.llama_server import LlamaServerBackend, ServerConfig
from chatcli.core.backend import BackendError, GenerationResult, GrammarError, Sampling
from tests.remote_drive import alive, remote_session
from tests.remote_server import SKIP_REASON, LlamaServer, server_binary

pytestmark = pytest.mark.skipif(server_binary() is None, reason=SKIP_REASON)

GREEDY = Sampling(temperature=0.0, repeat_penalty=1.0)
N_CTX = 2048


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """Flash attention off, as in the local engine (kvformat.KV_PARAMS; the server's default is "auto", on
    for this CPU): the same computation on both sides, so the same logits and the same tokens."""
    base = tmp_path_factory.mktemp("llama-server")
    srv = LlamaServer(model_path, n_ctx=N_CTX, slot_save_path=base / "slots", log_path=base / "server.log",
                      extra=["-fa", "off"])
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def backend(server: LlamaServer) -> Iterator[LlamaServerBackend]:
    b = LlamaServerBackend(ServerConfig(alive(server).url, read_timeout=120))
    yield b
    b.close()


def prompt_of(b: LlamaServerBackend, text: str) -> list[int]:
    return b.tokenize(f"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
                      "<|im_start|>assistant\n")


def remote_reply(b: LlamaServerBackend, prompt: list[int], sampling: Sampling, *, seed: int = 7,
                 max_tokens: int = 16) -> list[int]:
    b.truncate(0)
    for _ in b.eval_steps(prompt):
        pass
    res = GenerationResult()
    for _ in b.generate(sampling, seed=seed, max_tokens=max_tokens, result=res):
        pass
    return res.tokens


def local_reply(engine: object, prompt: list[int], sampling: Sampling, *, seed: int = 7, max_tokens: int = 16) -> list[int]:
    from chatcli.backends.llamacpp import Engine

    assert isinstance(engine, Engine)
    engine.clear()
    engine.eval(prompt)
    res = GenerationResult()
    for _ in engine.generate(sampling, seed=seed, max_tokens=max_tokens, result=res):
        pass
    return res.tokens


def test_greedy_reply_equals_the_local_engine(backend: LlamaServerBackend, engine: object) -> None:
    """Same tokens in, same greedy tokens out, with the same stop reason, and the slot holds exactly them."""
    prompt = prompt_of(backend, "Name three colours.")
    res = GenerationResult()
    backend.truncate(0)
    for _ in backend.eval_steps(prompt):
        pass
    for _ in backend.generate(GREEDY, seed=7, max_tokens=20, result=res):
        pass
    from chatcli.backends.llamacpp import Engine

    assert isinstance(engine, Engine)
    engine.clear()
    engine.eval(prompt)
    local = GenerationResult()
    for _ in engine.generate(GREEDY, seed=7, max_tokens=20, result=local):
        pass
    assert res.tokens == local.tokens
    assert res.stop_reason == local.stop_reason
    assert backend.tokens == prompt + res.tokens


def test_logit_bias_ban_changes_the_reply_as_on_the_local_engine(backend: LlamaServerBackend, engine: object) -> None:
    prompt = prompt_of(backend, "Name a fruit.")
    plain = remote_reply(backend, prompt, GREEDY)
    assert plain == local_reply(engine, prompt, GREEDY)
    banned = Sampling(temperature=0.0, repeat_penalty=1.0, logit_bias=((plain[0], -100.0),))
    remote = remote_reply(backend, prompt, banned)
    assert remote[0] != plain[0]
    assert remote == local_reply(engine, prompt, banned)
    # A ban as -inf (no JSON number: sent as false) bans the same way.
    assert remote_reply(backend, prompt, Sampling(temperature=0.0, repeat_penalty=1.0,
                                                  logit_bias=((plain[0], -math.inf),))) == remote
    assert backend.stats.last_settings["logit_bias"][0]["token"] == plain[0]
    # An id the server would drop without a word is refused here, before anything is sent.
    before = backend.stats.requests
    with pytest.raises(BackendError, match="not in the vocabulary"):
        remote_reply(backend, prompt, Sampling(logit_bias=((backend.n_vocab, 5.0),)))
    assert backend.stats.requests == before  # the prompt waits for the reply's request, never sent


def test_seeded_sampling_with_min_p_and_penalties_equals_the_local_engine(
        backend: LlamaServerBackend, engine: object) -> None:
    """Same chain on both (logit bias, penalties, top-k, top-p, min-p, temperature, dist), same seed: the
    same tokens, and the server's own account of the request names every field."""
    prompt = prompt_of(backend, "Write a sentence about dogs, dogs and more dogs.")
    s = Sampling(temperature=1.0, top_k=40, top_p=0.95, min_p=0.1, repeat_penalty=1.05, presence_penalty=0.6,
                 frequency_penalty=0.4)
    remote = remote_reply(backend, prompt, s, seed=11, max_tokens=24)
    assert remote == local_reply(engine, prompt, s, seed=11, max_tokens=24)
    got = backend.stats.last_settings
    assert got["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    assert (got["min_p"], got["presence_penalty"], got["frequency_penalty"]) == pytest.approx((0.1, 0.6, 0.4))
    # The fields are what made the difference: the same seed without them samples another reply.
    assert remote != remote_reply(backend, prompt, Sampling(temperature=1.0, repeat_penalty=1.05), seed=11,
                                  max_tokens=24)


def test_json_grammar_constrains_the_reply_as_on_the_local_engine(backend: LlamaServerBackend, engine: object) -> None:
    from chatcli.backends.llamacpp import Engine

    assert isinstance(engine, Engine) and backend.caps.grammar
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}
    assert backend.json_grammar() == engine.json_grammar()
    assert backend.json_grammar(schema) == engine.json_grammar(schema)
    prompt = prompt_of(backend, "How old is the cat?")
    s = Sampling(temperature=0.0, repeat_penalty=1.0, grammar=backend.json_grammar(schema))
    remote = remote_reply(backend, prompt, s, max_tokens=32)
    assert remote == local_reply(engine, prompt, s, max_tokens=32)
    doc = json.loads(b"".join(backend.piece(t) for t in remote if not backend.is_eog(t)))
    assert set(doc) == {"age"} and isinstance(doc["age"], int)
    with pytest.raises(GrammarError, match="schema"):
        backend.json_grammar({"$ref": "#/nowhere"})


def test_a_grammar_the_server_refuses_is_one_grammar_error(backend: LlamaServerBackend) -> None:
    prompt = prompt_of(backend, "Say hi.")
    backend.truncate(0)
    for _ in backend.eval_steps(prompt):
        pass
    # A token named by its text needs the vocabulary: only the server, which has it, can refuse this one.
    bad = Sampling(temperature=0.0, repeat_penalty=1.0, grammar='root ::= "a" <|not-a-token|>')
    with pytest.raises(GrammarError) as info:
        for _ in backend.generate(bad, seed=1, max_tokens=4):
            pass
    assert "grammar" in str(info.value) and "\n" not in str(info.value)
    assert backend.tokens == prompt  # nothing changed: the next reply is the plain one
    assert remote_reply(backend, prompt, GREEDY, max_tokens=4)
    # A grammar that leaves the model no token mid-reply: one GrammarError too, the tokens it allowed kept.
    dead_end = Sampling(temperature=0.0, repeat_penalty=1.0, grammar=f'root ::= "a" <[{backend.n_vocab + 5}]>')
    backend.truncate(len(prompt))
    with pytest.raises(GrammarError, match="grammar"):
        for _ in backend.generate(dead_end, seed=1, max_tokens=4):
            pass
    assert backend.tokens[: len(prompt)] == prompt


def test_the_http_service_over_a_remote_server_honours_response_format(server: LlamaServer, tmp_path: Path) -> None:
    """The HTTP app's request path (ChatService._sampling: ``json_grammar``, then ``generate``) over the
    remote backend. ``chatcli serve`` itself refuses ``--server`` (``Session.local_model``, which the service
    reads for the model's name only): the session is given the bundled file's ModelRef for that name."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from chatcli.models.resolve import resolve_model
    from chatcli.server.app import create_app
    from chatcli.server.service import ChatService

    session = remote_session(alive(server).url, max_tokens=48)
    svc = ChatService(dataclasses.replace(session, model=resolve_model(None)), parallel=1,
                      index_path=tmp_path / "index.json")
    try:
        with TestClient(create_app(svc)) as http:
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Give me a JSON object with the name and colour of a fruit."}],
                "temperature": 0, "max_tokens": 48, "response_format": {"type": "json_object"}})
            assert r.status_code == 200, r.text
            assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
            bad = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/x"}}}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
    finally:
        svc.close()
        session.close()
