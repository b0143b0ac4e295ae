"""Which stored conversation a request continues (the server's service, in-process, real model, greedy).

One model load for the module; each test gets its own store (rebind) and its own ChatService over the
module's engine, so the tests' conversations never meet.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from chatcli.core.template import Message
from chatcli.server.service import ChatRequest, ChatService, Finished, Started
from chatcli.session import Session
from tests.drive import isolated_session, rebind

SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def module_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    s = isolated_session(tmp_path_factory.mktemp("choice-home"), max_tokens=12)
    yield s
    s.close()


@pytest.fixture
def service(module_session: Session, tmp_path: Path) -> Iterator[ChatService]:
    s = rebind(module_session)
    s.engine.clear()
    svc = ChatService(s, parallel=1, index_path=tmp_path / "index.json")
    yield svc
    svc.close()


def ask(svc: ChatService, msgs: list[tuple[str, str]]) -> tuple[Started, Finished]:
    started: Started | None = None
    finished: Finished | None = None
    for ev in svc.complete(ChatRequest([Message(r, c) for r, c in msgs], temperature=0.0, max_tokens=12, seed=1)):
        if isinstance(ev, Started):
            started = ev
        elif isinstance(ev, Finished):
            finished = ev
    assert started is not None and finished is not None
    assert finished.cached_tokens + finished.evaluated == finished.prompt_tokens
    return started, finished


def meta(svc: ChatService, cid: str) -> dict[str, Any]:
    return svc.store.resolve(cid).read_meta()


def test_a_new_conversation_sharing_only_the_persona_is_not_a_fork(service: ChatService) -> None:
    _, a = ask(service, [("system", SYSTEM), ("user", "Name a fruit.")])
    st, b = ask(service, [("system", SYSTEM), ("user", "What is a ship?")])
    assert b.conversation != a.conversation
    assert (st.forked_from, b.forked_from, b.state) == (None, None, "new")
    assert "forked_from" not in meta(service, b.conversation)
    # No system message at all: also new, also no parent.
    _, c = ask(service, [("user", "Name a colour.")])
    _, d = ask(service, [("user", "Name a city.")])
    assert (c.forked_from, d.forked_from, d.state) == (None, None, "new")
    assert "forked_from" not in meta(service, d.conversation)
