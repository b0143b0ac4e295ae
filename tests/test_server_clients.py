"""API clients are isolated from each other and from the REPL, and a full queue is a 503 (the HTTP app
in-process over the real model, the official openai client with one key per client)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from chatcli.core.template import Message  # noqa: E402
from chatcli.server.app import ServerLimits, create_app  # noqa: E402
from chatcli.server.service import ChatRequest, ChatService, Started  # noqa: E402
from chatcli.session import Session  # noqa: E402
from tests.drive import isolated_session, rebind  # noqa: E402

KEYS = ("key-of-alice-0001", "key-of-bob-000002")
HISTORY = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def module_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    s = isolated_session(tmp_path_factory.mktemp("clients-home"), max_tokens=8)
    yield s
    s.close()


def make(module_session: Session, tmp_path: Path, **kw: Any) -> tuple[ChatService, TestClient]:
    s = rebind(module_session)
    s.engine.clear()
    svc = ChatService(s, parallel=1, index_path=tmp_path / "index.json", repl_access=kw.pop("repl_access", False))
    return svc, TestClient(create_app(svc, api_keys=KEYS, **kw))


@pytest.fixture
def app(module_session: Session, tmp_path: Path) -> Iterator[tuple[ChatService, TestClient]]:
    svc, http = make(module_session, tmp_path)
    with http:
        yield svc, http
    svc.close()


def chat(http: TestClient, key: str, messages: list[dict[str, str]], **kw: Any) -> Any:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
    return client.chat.completions.with_raw_response.create(model="any", messages=messages, temperature=0,
                                                            max_tokens=8, **kw)


def result(raw: Any) -> tuple[str, str, Any, dict[str, Any]]:
    comp = raw.parse()
    ext = (comp.model_extra or {}).get("chatcli") or {}
    return raw.headers["x-chatcli-conversation"], comp.choices[0].message.content, comp.usage, ext


def post(http: TestClient, key: str, **body: Any) -> Any:
    return http.post("/v1/chat/completions", json={"temperature": 0, "max_tokens": 8, **body},
                     headers={"Authorization": f"Bearer {key}"})


def test_two_clients_with_the_same_history_never_share_a_conversation(app: tuple[ChatService, TestClient]) -> None:
    svc, http = app
    a_id, a_text, _, _ = result(chat(http, KEYS[0], HISTORY))
    b_id, b_text, _, ext = result(chat(http, KEYS[1], HISTORY))
    assert a_id != b_id and a_text == b_text  # same model, same greedy reply, two conversations
    assert ext["forked_from"] is None and ext["state_from"] == "new"
    # Bob's continuation of the shared-looking history goes into Bob's conversation, never Alice's.
    nxt = [*HISTORY, {"role": "assistant", "content": b_text}, {"role": "user", "content": "Another."}]
    assert result(chat(http, KEYS[1], nxt))[0] == b_id
    assert result(chat(http, KEYS[0], nxt))[0] == a_id
    # An edit forks the client's own conversation only.
    edit = [*HISTORY, {"role": "assistant", "content": a_text}, {"role": "user", "content": "A colour?"}]
    _, _, _, ext = result(chat(http, KEYS[1], edit))
    assert ext["forked_from"] in (b_id, None) and ext["forked_from"] != a_id
    metas = {cid: svc.store.resolve(cid).read_meta() for cid in svc.store.ids()}
    assert all(KEYS[0] not in str(m) and KEYS[1] not in str(m) for m in metas.values())  # ids, never keys


def test_naming_another_clients_conversation_is_a_404_that_names_nothing(app: tuple[ChatService, TestClient]) -> None:
    _, http = app
    a_id, a_text, _, _ = result(chat(http, KEYS[0], HISTORY))
    nxt = [*HISTORY, {"role": "assistant", "content": a_text}, {"role": "user", "content": "Another."}]
    for ref in (a_id, a_id[:2], "zzzzzz"):  # another's whole id, a prefix, nothing
        r = post(http, KEYS[1], messages=nxt, conversation=ref)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["param"] == "conversation" and a_id not in err["message"]
    assert post(http, KEYS[0], messages=nxt, conversation=a_id).status_code == 200  # the owner can


def test_repl_conversations_are_reachable_only_when_shared(module_session: Session, tmp_path: Path) -> None:
    # A conversation made outside the API (the REPL's source is not "api").
    svc, http = make(module_session, tmp_path)
    with http:
        a_id, a_text, _, _ = result(chat(http, KEYS[0], HISTORY))
    svc.close()
    d = svc.store.resolve(a_id)
    meta = d.read_meta()
    del meta["source"], meta["api_client"]
    d.write_meta(meta)
    nxt = [*HISTORY, {"role": "assistant", "content": a_text}, {"role": "user", "content": "Another."}]
    for shared in (True, False):  # shared first: a conversation made while not shared would match after
        svc, http = make(module_session, tmp_path / str(shared), repl_access=shared)
        with http:
            cid = result(chat(http, KEYS[1], nxt))[0]
            named = post(http, KEYS[1], messages=nxt, conversation=a_id).status_code
        svc.close()
        assert (cid == a_id) is shared
        assert named == (200 if shared else 404)


def test_a_full_queue_is_a_503_with_retry_after(module_session: Session, tmp_path: Path) -> None:
    svc, http = make(module_session, tmp_path, limits=ServerLimits(max_queue=0))
    with http:
        # The one context is busy (a request of the service's own, held at its first event); the app
        # admits one request (parallel 1 + queue 0), which waits for the context ...
        held = svc.complete(ChatRequest([Message("user", "Count to ten.")], temperature=0.0, max_tokens=8))
        assert isinstance(next(held), Started)
        waiting: list[int] = []
        t = threading.Thread(target=lambda: waiting.append(post(http, KEYS[0], messages=HISTORY).status_code))
        t.start()
        deadline = time.monotonic() + 60
        while http.app.state.admitted() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.app.state.admitted() == 1
        # ... so the next is refused at once, before its body is read.
        r = post(http, KEYS[1], messages=HISTORY)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "server_error"
        held.close()
        t.join(120)
        assert waiting == [200]
        assert post(http, KEYS[1], messages=HISTORY).status_code == 200  # room again
    svc.close()
