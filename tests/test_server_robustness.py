"""The server stays up and says one clear 4xx line when a request, a folder or the disk is bad (the HTTP app
in-process over a real model; an OpenAI error object for every refusal; nothing left behind)."""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient

from chatcli.core.files.store import ConversationDir, LockedError, StoreError
from chatcli.core.forking import fork_after
from chatcli.core.template import Message
from chatcli.core.transcript import replay_events
from chatcli.server.service import ChatRequest, ChatService, Finished, ServiceError, Started
from chatcli.session import Session

SYSTEM = "You are terse."


# The module's model load, its ChatService and HTTP app per test: tests/golden.py's base_session, sess,
# chat_service and chat_http.
BASE_SESSION = {"threads": 2, "n_ctx": 2048, "max_tokens": 8}


def body(*msgs: tuple[str, str], **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in msgs], "temperature": 0, "max_tokens": 8, **kw}


def ask(svc: ChatService, msgs: list[tuple[str, str]], **kw: Any) -> Finished:
    out = [ev for ev in svc.complete(ChatRequest([Message(r, c) for r, c in msgs], temperature=0.0, max_tokens=8,
                                                 seed=1, **kw)) if isinstance(ev, Finished)]
    assert len(out) == 1
    return out[0]


def folders(svc: ChatService) -> list[str]:
    return svc.store.ids()


def assert_error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    return dict(err)


# -- bodies found by fuzzing ------------------------------------------------------------------------------


def test_a_lone_surrogate_is_a_400_and_leaves_nothing(chat_http: TestClient, chat_service: ChatService) -> None:
    raw = '{"messages": [{"role": "user", "content": "hi \\ud800"}]}'
    err = assert_error(chat_http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}),
                       400)
    assert "surrogate" in err["message"]
    assert folders(chat_service) == []
    # A surrogate pair escaped the JSON way is one real character: accepted.
    ok = chat_http.post("/v1/chat/completions", content=json.dumps(body(("user", "Say \U0001F600.")), ensure_ascii=True),
                   headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_a_deeply_nested_body_is_a_400(chat_http: TestClient) -> None:
    raw = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
    err = assert_error(chat_http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}),
                       400)
    assert "nested" in err["message"]


# -- folders the server cannot use ------------------------------------------------------------------------


def _bad_folders(chat_service: ChatService) -> list[str]:
    """A newer chatcli's folder, two with wrongly typed metadata, one whose transcript cannot be read."""
    out = []
    for change in ({"format": 2}, {"model": "x"}, {"updated": "x"}, None):
        d = chat_service.store.create({"title": "bad"})
        d.append_event({"type": "note", "text": "x"})
        if change is None:
            d.transcript_path.unlink()
            d.transcript_path.mkdir()  # stat works, reading fails (root reads any file: a folder it cannot)
        else:
            meta = json.loads(d.meta_path.read_text())
            meta.update(change)
            d.meta_path.write_text(json.dumps(meta))
        out.append(d.id)
    return out


def test_unusable_folders_are_skipped_at_start_and_at_run_time(
        sess: Session, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sess.engine.clear()
    svc0 = ChatService(sess, parallel=1, index_path=tmp_path / "i0.json")
    bad = _bad_folders(svc0)
    svc0.close()
    svc = ChatService(sess, parallel=1, index_path=tmp_path / "i1.json")  # was: exits at start
    try:
        assert ask(svc, [("system", SYSTEM), ("user", "Name a fruit.")]).text
        bad += _bad_folders(svc)  # appear while it runs: was a 500 for every request
        caplog.clear()
        with caplog.at_level("WARNING", logger="chatcli.server"):
            assert ask(svc, [("system", SYSTEM), ("user", "Name a colour.")]).text
            assert ask(svc, [("system", SYSTEM), ("user", "Name a city.")]).text
        skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert len(skipped) == 4  # the run-time ones, once each (not again at the next request)
        assert all(b in svc.store.ids() for b in bad)  # skipped, never touched
    finally:
        svc.close()


# -- nothing is left by a request that fails ---------------------------------------------------------------


def test_an_oversized_system_prompt_creates_nothing_and_answers_the_same(chat_http: TestClient,
                                                                        chat_service: ChatService) -> None:
    big = body(("system", "word " * 2500), ("user", "Hi."))
    first = assert_error(chat_http.post("/v1/chat/completions", json=big), 400)
    second = assert_error(chat_http.post("/v1/chat/completions", json=big), 400)
    assert first == second and first["code"] == "context_length_exceeded"
    assert folders(chat_service) == []


def test_a_failed_record_of_a_cut_reply_still_frees_the_lock(chat_service: ChatService,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Client gone and disk full: recording the reply so far fails, the conversation is still unlocked and
    the context given back (the next request is served)."""
    it = chat_service.complete(ChatRequest([Message("user", "Count from one to twenty.")], temperature=0.0,
                                      max_tokens=8, seed=1))
    started = next(it)
    assert isinstance(started, Started)
    next(it)  # a delta: the reply is being generated

    def full(self: ConversationDir, event: dict[str, Any]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ConversationDir, "append_event", full)
    with pytest.raises(OSError):
        it.close()
    monkeypatch.undo()
    d = chat_service.store.resolve(started.conversation)
    d.lock()  # was: LockedError, held until the server stops
    d.unlock()
    assert ask(chat_service, [("user", "Name a fruit.")]).text


def test_a_stale_fork_is_a_409(chat_service: ChatService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent lost the boundary the index knows (a REPL /undo between the refresh and the fork)."""
    h: list[tuple[str, str]] = [("system", SYSTEM)]
    for q in ("Name a fruit.", "Name a colour.", "Name a city."):
        f = ask(chat_service, [*h, ("user", q)])
        h += [("user", q), ("assistant", f.text)]
    cid = f.conversation
    d = chat_service.store.resolve(cid)
    lines = d.transcript_path.read_bytes().splitlines(keepends=True)
    kept = [ln for ln in lines if json.loads(ln)["type"] != "message" or json.loads(ln)["mid"] < 2]
    chat_service.index.refresh()
    monkeypatch.setattr(chat_service.index, "refresh", lambda save=True: None)  # the index stays as it was
    d.transcript_path.write_bytes(b"".join(kept))
    with pytest.raises(ServiceError) as exc:
        ask(chat_service, [*h[:5], ("user", "Name a planet.")])  # an edit: fork after message 4
    assert exc.value.kind == "conflict"  # was: a bare ValueError, a 500


# -- what clients see of each other and of the store -----------------------------------------------------


def test_a_locked_conversation_is_a_409_without_a_pid(chat_http: TestClient, chat_service: ChatService) -> None:
    f = ask(chat_service, [("user", "Name a fruit.")])
    d = ConversationDir(chat_service.store.root / f.conversation)
    d.lock()
    try:
        r = chat_http.post("/v1/chat/completions", json=body(("user", "Name a fruit."), ("assistant", f.text),
                                                        ("user", "Another."), conversation=f.conversation))
        err = assert_error(r, 409)
        assert str(os.getpid()) not in err["message"] and "process " not in err["message"]
    finally:
        d.unlock()


def test_a_title_set_in_the_repl_survives_the_next_request(chat_service: ChatService) -> None:
    f = ask(chat_service, [("user", "Name a fruit.")])
    d = chat_service.store.resolve(f.conversation)
    meta = d.read_meta()
    d.write_meta({**meta, "title": "set in the REPL"})  # another process, between two requests
    g = ask(chat_service, [("user", "Name a fruit."), ("assistant", f.text), ("user", "Another.")])
    assert (g.conversation, g.state) == (f.conversation, "memory")  # still no restore for a title
    assert d.read_meta()["title"] == "set in the REPL"


def test_the_finish_chunk_carries_usage_only_when_asked(chat_http: TestClient) -> None:
    def chunks(**kw: Any) -> list[dict[str, Any]]:
        r = chat_http.post("/v1/chat/completions", json=body(("user", "Name a fruit."), stream=True, **kw))
        assert r.status_code == 200
        return [json.loads(ln[5:]) for ln in r.text.splitlines() if ln.startswith("data:") and "[DONE]" not in ln]

    plain = chunks()
    assert all(c.get("usage") is None for c in plain)
    asked = chunks(stream_options={"include_usage": True})
    with_usage = [c for c in asked if c.get("usage") is not None]
    assert len(with_usage) == 1 and with_usage[0]["choices"] == []


# -- small ones -----------------------------------------------------------------------------------------


def test_an_id_with_a_trailing_newline_is_refused(chat_service: ChatService) -> None:
    with pytest.raises(StoreError):
        chat_service.store.validate_id("abc\n")


def test_a_fork_does_not_copy_the_parents_eviction_mark(chat_service: ChatService) -> None:
    f = ask(chat_service, [("user", "Name a fruit.")])
    parent = chat_service.store.resolve(f.conversation)
    parent.write_meta({**parent.read_meta(), "evicted": {"at": 1.0}})
    child, _ = fork_after(chat_service.store, parent, 1, {"source": "api"})
    meta = chat_service.store.resolve(child).read_meta()
    assert "evicted" not in meta and meta["forked_from"] == parent.id
    assert len(replay_events(chat_service.store.resolve(child).read_transcript().events).active) == 1


def test_an_ipv6_host_in_brackets_binds() -> None:
    from chatcli.server.run import bind_address, listen_socket, url_host

    assert bind_address("[::1]") == (socket.AF_INET6, "::1")
    assert url_host("::1") == url_host("[::1]") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1"
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = int(s.getsockname()[1])
    listen_socket("[::1]", port).close()  # was: "cannot listen on [::1]: ..."


def test_locked_error_is_still_what_the_store_raises(chat_service: ChatService) -> None:
    """The 409 above is the service's wording: the store's own message (with its PID) stays for the CLI."""
    d = chat_service.store.create({"title": "x"})
    d.lock()
    try:
        with pytest.raises(LockedError, match="process"):
            ConversationDir(d.path).lock()
    finally:
        d.unlock()
