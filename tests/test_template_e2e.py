"""A reasoning template on the real llama.cpp: the bundled SmolLM2 (attention KV) under Qwen3.5-4B's template
given with ``chat_template`` (thinking on: its generation prompt opens ``<think>``, so every reply starts as
reasoning). Talk, resume with nothing re-evaluated, regenerate evaluating nothing, the context never showing a
reply twice; and ``serve`` continuing a 6-turn chat whose client strips the reasoning (or returns it in
``reasoning_content``) with >= 95 % of the prompt cached from the second turn on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chatcli.config.settings import get_paths, load_settings_explicit
from chatcli.core.conversation import Conversation
from chatcli.core.events import ReplyEnd
from chatcli.models.resolve import resolve_model
from chatcli.session import Session
from tests.test_templates_all import TEMPLATE_DIR

pytestmark = pytest.mark.skipif(TEMPLATE_DIR is None, reason="llama.cpp's models/templates not found")

QWEN35 = "Qwen3.5-4B"


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    assert TEMPLATE_DIR is not None
    home = tmp_path_factory.mktemp("tpl") / "home"
    tmpl = home.parent / "qwen35.jinja"
    tmpl.write_text((TEMPLATE_DIR / f"{QWEN35}.jinja").read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHATCLI_HOME", str(home))
        flags = {"temperature": 0.0, "seed": 7, "n_ctx": 2048, "reserve": 64, "max_tokens": 24, "threads": 2,
                 "chat_template": str(tmpl), "thinking": True}
        settings, explicit = load_settings_explicit(flags, paths=get_paths())
        s = Session.build(settings, get_paths(), model=resolve_model(None), explicit=explicit)
    yield s
    s.close()


@pytest.fixture
def sess(session: Session, chatcli_home: Path) -> Session:
    from tests.drive import rebind

    return rebind(session)


def _new(session: Session) -> Conversation:
    return session.new_conversation("alice").conversation


def _say(conv: Conversation, text: str) -> ReplyEnd:
    ends = [ev for ev in conv.send(text) if isinstance(ev, ReplyEnd)]
    assert ends
    return ends[-1]


def test_talk_resume_regen_under_a_reasoning_template(sess: Session) -> None:
    assert sess.template.opens_reasoning() and sess.template.origin
    conv = _new(sess)
    assert conv.meta["chat_template"]["source"] == sess.template.source and conv.meta["thinking"] is True
    ends = [_say(conv, q) for q in ("Name a colour.", "And a fruit?", "Thanks!")]
    for end in ends:
        m = end.message
        assert m.reasoning or m.answer is None  # every reply starts as reasoning under this template
        if m.reasoning:
            assert m.reasoning_tokens > 0 and m.text.strip().startswith(m.reasoning[:8])
    # The context holds each user message once (nothing re-evaluated twice) and equals the transcript's tokens.
    assert list(sess.engine.tokens) == conv.r.tokens()
    text = b"".join(sess.engine.piece(t) for t in sess.engine.tokens).decode("utf-8", "replace")
    for q in ("Name a colour.", "And a fruit?", "Thanks!"):
        assert text.count(q) == 1
    tokens = list(sess.engine.tokens)
    cid = conv.id
    conv.close()
    sess.engine.clear()

    opening = sess.open_conversation(cid)
    conv2, report = opening.conversation, opening.report
    assert report is not None
    assert report.reevaluated == 0 and list(sess.engine.tokens) == tokens

    end = [ev for ev in conv2.regen() if isinstance(ev, ReplyEnd)][-1]
    assert end.stats.n_prompt == 0 and not end.stats.reevaluated  # sampled from the saved logits
    conv2.close()


def _chat(service: Any, messages: list[dict[str, Any]]) -> Any:
    """One request as the HTTP layer parses it (its schema drops fields it does not know)."""
    from chatcli.server.schemas import parse_chat_request
    from chatcli.server.service import Delta, Finished

    req, _ = parse_chat_request({"model": "x", "messages": messages, "temperature": 0, "max_tokens": 24, "seed": 1},
                                max_messages=1000, header_conversation=None)
    deltas: list[Any] = []
    fin = None
    for ev in service.complete(req):
        if isinstance(ev, Delta):
            deltas.append(ev)
        elif isinstance(ev, Finished):
            fin = ev
    assert fin is not None, "no reply"
    return fin, deltas


@pytest.mark.parametrize("client", ["strips-reasoning", "reasoning_content"])
def test_serve_keeps_the_cache_when_the_client_strips_reasoning(sess: Session, client: str) -> None:
    pytest.importorskip("starlette")
    from chatcli.server.service import ChatService

    sess.engine.clear()
    service = ChatService(sess, index_path=sess.paths.data_dir / "server" / "index.json")
    try:
        # A system prompt of a few hundred tokens, as real ones are: the share a new user message takes of
        # the prompt is then what it is in use (with a 10-token prompt no history could be 95 % cached).
        system = f"You are terse ({client}). " + " ".join(f"Rule {k}: answer in one short sentence." for k in range(40))
        msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
        ratios, reasoned = [], 0
        for i in range(6):
            msgs.append({"role": "user", "content": f"Question number {i + 1}: say a word."})
            fin, deltas = _chat(service, msgs)
            assert "".join(d.text for d in deltas if d.reasoning).strip() == fin.reasoning  # streamed apart
            assert "".join(d.text for d in deltas if not d.reasoning) == fin.text
            assert "</think>" not in fin.text and "</think>" not in fin.reasoning
            reasoned += bool(fin.reasoning)
            if i:
                ratios.append(fin.cached_tokens / fin.prompt_tokens)
                # Only the new user message was evaluated, with its markup (user header, end of turn, assistant
                # header and the opened think block, ~13 tokens in SmolLM2's vocabulary): the stored
                # conversation matched. A miss would evaluate the previous reply again (24 tokens) or all.
                n_user = len(sess.engine.tokenize(msgs[-1]["content"], add_special=False))
                assert fin.evaluated <= n_user + 16 and fin.forked_from is None, (fin.evaluated, n_user)
            # The client keeps the answer only: the reasoning is dropped, or sent back in reasoning_content
            # as DeepSeek's API convention has it (not part of the content).
            reply: dict[str, Any] = {"role": "assistant", "content": fin.text}
            if client == "reasoning_content":
                reply["reasoning_content"] = fin.reasoning
            msgs.append(reply)
        assert reasoned >= 1  # the case at hand: the stored replies hold reasoning the client does not send
        assert min(ratios) >= 0.95, ratios
        print(client, "cached from turn 2:", [f"{r:.3f}" for r in ratios])
    finally:
        service.close()


def test_cli_chat_template_is_remembered_and_a_bad_file_is_one_line(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from chatcli.cli.app import app

    assert TEMPLATE_DIR is not None
    runner = CliRunner()
    tmpl = tmp_path / "qwen35.jinja"
    tmpl.write_text((TEMPLATE_DIR / f"{QWEN35}.jinja").read_text())
    greedy = ["--temperature", "0", "--max-tokens", "12", "--n-ctx", "1024"]
    r = runner.invoke(app, ["talk", "--chat-template", str(tmpl), "--thinking", *greedy], input="Hi there\n")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert "thinking · " in r.stderr and "</think>" not in r.stdout  # the reasoning on stderr, folded
    shown = runner.invoke(app, ["show", "--json"])
    meta = json.loads(shown.stdout)["meta"]
    assert meta["chat_template"]["file"] == str(tmpl) and meta["thinking"] is True
    tmpl.unlink()  # resume needs the remembered text, not the file
    r = runner.invoke(app, ["resume", *greedy[:4]], input="More\n")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert "re-evaluated 0 tokens" in r.stderr
    exported = json.loads(runner.invoke(app, ["export", "--format", "json", "--reasoning"]).stdout)
    assert [m["role"] for m in exported][-4:] == ["user", "assistant", "user", "assistant"]
    assert any("reasoning_content" in m for m in exported)

    r = runner.invoke(app, ["talk", "--chat-template", str(tmp_path / "nope.jinja")], input="hi\n")
    assert r.exit_code != 0 and r.stderr.count("\n") == 1 and "cannot read the chat template" in r.stderr
    assert "Traceback" not in r.stderr


def test_http_reasoning_content_in_message_and_stream(tmp_path: Path) -> None:
    """`chatcli serve --chat-template FILE --thinking` over HTTP: the reply's reasoning in
    ``message.reasoning_content`` and in the stream's ``delta.reasoning_content``, the answer in ``content``."""
    pytest.importorskip("starlette")
    import json
    import os
    import subprocess
    import sys
    import time

    from tests.test_server import free_port, request

    assert TEMPLATE_DIR is not None
    tmpl = tmp_path / "qwen35.jinja"
    tmpl.write_text((TEMPLATE_DIR / f"{QWEN35}.jinja").read_text())
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    root = Path(__file__).resolve().parent.parent
    env.update(CHATCLI_HOME=str(tmp_path / "home"), PYTHONPATH=str(root) + os.pathsep + env.get("PYTHONPATH", ""))
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "chatcli", "serve", "--port", str(port), "--n-ctx", "1024",
                             "--threads", "2", "--max-tokens", "16", "--chat-template", str(tmpl), "--thinking"],
                            env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if request(port, "GET", "/health", timeout=2).status_code == 200:
                    break
            except OSError:
                time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0, "max_tokens": 16}
        r = request(port, "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        msg = r.json()["choices"][0]["message"]
        assert r.status_code == 200 and msg["reasoning_content"] and "<think>" not in msg["content"]
        r = request(port, "POST", "/v1/chat/completions", json.dumps({**body, "stream": True, "seed": 5}),
                    {"Content-Type": "application/json"})
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
                  if line.startswith("data: {") and '"choices": []' not in line and "choices" in line]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        assert reasoning.strip() and all("<think>" not in d.get("content", "") for d in deltas)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
