"""Real chat templates on llama.cpp's own per-architecture fixture models (tests/archs.py): talk, resume with
nothing re-evaluated, regenerate evaluating nothing, and ``serve`` continuing when the client sends the replies
back without their reasoning.

The fixtures have random weights and llama.cpp's dummy vocabulary (no EOS: every reply runs to max_tokens), a
trained context of 256 tokens, and no chat template: ``with_template`` writes a copy with the one under test.
Their replies are noise; the claims are about tokens and state, which do not care.
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
from tests.archs import ArchFixtures, with_template
from tests.test_templates_all import TEMPLATE_DIR

pytestmark = pytest.mark.skipif(TEMPLATE_DIR is None, reason="llama.cpp's models/templates not found")

# (template, fixture architecture, memory): the pairs issue #21 names. The hybrid ones need rollback points and
# gpt-oss's sliding-window cache a restore of its own (issue #20).
CASES = [
    ("openai-gpt-oss-120b", "gpt-oss", "sliding-window attention"),
    ("Qwen3.5-4B", "qwen35", "hybrid"),
    ("LFM2.5-Instruct", "lfm2", "hybrid"),
    ("ibm-granite-granite-4.0", "granitehybrid", "hybrid"),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "nemotron_h", "hybrid"),
]
N_CTX = 256
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=CASES, ids=[f"{t}@{a}" for t, a, _ in CASES])
def case_session(request: pytest.FixtureRequest, arch_fixtures: ArchFixtures,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Session, str]]:
    template, arch, _memory = request.param
    assert TEMPLATE_DIR is not None
    root = tmp_path_factory.mktemp(f"tpl-{arch}")
    model = with_template(arch_fixtures.path(arch), (TEMPLATE_DIR / f"{template}.jinja").read_text(),
                          root / f"{arch}-{template}.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHATCLI_HOME", str(root / "home"))
        flags = {"temperature": 0.0, "seed": 3, "n_ctx": N_CTX, "reserve": 16, "max_tokens": MAX_TOKENS,
                 "threads": 2, "model": str(model)}
        settings, explicit = load_settings_explicit(flags, paths=get_paths())
        s = Session.build(settings, get_paths(), model=resolve_model(str(model)), explicit=explicit)
    yield s, request.param[2]
    s.close()


@pytest.fixture
def sess(case_session: tuple[Session, str], chatcli_home: Path) -> Session:
    from tests.drive import rebind

    return rebind(case_session[0])


def _say(conv: Conversation, text: str) -> ReplyEnd:
    ends = [ev for ev in conv.send(text) if isinstance(ev, ReplyEnd)]
    assert ends
    return ends[-1]


def test_talk_resume_regen(sess: Session) -> None:
    sess.engine.clear()
    conv = sess.new_conversation("alice").conversation
    for q in ("hi there", "and then"):
        _say(conv, q)
    assert list(sess.engine.tokens) == conv.r.tokens()
    tokens, cid = list(sess.engine.tokens), conv.id
    conv.close()
    sess.engine.clear()
    opening = sess.open_conversation(cid)
    conv2, report = opening.conversation, opening.report
    assert report is not None
    assert report.reevaluated == 0 and list(sess.engine.tokens) == tokens
    end = [ev for ev in conv2.regen() if isinstance(ev, ReplyEnd)][-1]
    assert end.stats.n_prompt == 0 and not end.stats.reevaluated
    assert len(end.message.tokens) > 0
    conv2.close()


def _chat(service: Any, messages: list[dict[str, Any]]) -> Any:
    from chatcli.server.schemas import parse_chat_request
    from chatcli.server.service import Finished

    req, _ = parse_chat_request({"model": "x", "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
                                 "seed": 1}, max_messages=100, header_conversation=None)
    fins = [ev for ev in service.complete(req) if isinstance(ev, Finished)]
    assert fins
    return fins[-1]


def test_serve_continues_with_reasoning_stripped(sess: Session) -> None:
    pytest.importorskip("starlette")
    from chatcli.server.service import ChatService

    sess.engine.clear()
    service = ChatService(sess, index_path=sess.paths.data_dir / "server" / "index.json")
    try:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
        for i in range(3):
            msgs.append({"role": "user", "content": f"question {i}"})
            fin = _chat(service, msgs)
            if i:
                assert fin.forked_from is None and fin.state in ("memory", "disk"), fin
                assert fin.evaluated < fin.prompt_tokens // 2, fin  # the history was not evaluated again
            msgs.append({"role": "assistant", "content": fin.text})  # the answer only, as clients send it
    finally:
        service.close()
