"""A cold conversation's rebuild neither blocks other conversations nor outlives its client (the service
in-process, two contexts over the real model, greedy)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from chatcli.core.conversation import Conversation
from chatcli.core.kv import budget
from chatcli.core.template import Message
from chatcli.server.service import ChatRequest, ChatService, Finished, ServiceEvent, Started
from chatcli.session import Session
from tests.drive import isolated_session

SYSTEM = "You are terse. (cold)"


@pytest.fixture(scope="module")
def module_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    s = isolated_session(tmp_path_factory.mktemp("hol-home"), max_tokens=8, n_ctx=4096)
    yield s
    s.close()


@pytest.fixture(scope="module")
def cold(module_session: Session, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChatService, list[Message]]]:
    """A service with two contexts and a long conversation whose state file was dropped (cold)."""
    # The module session's own store (its temp home): rebind() here would take the CHATCLI_HOME of no test.
    s = module_session
    svc = ChatService(s, parallel=2, index_path=tmp_path_factory.mktemp("hol") / "index.json")
    h = [Message("system", SYSTEM)]
    for w in ("apple", "river", "stone", "cloud", "grass", "light"):
        h.append(Message("user", f"Count the words: {' '.join([w] * 400)}"))
        h.append(Message("assistant", next(ev.text for ev in svc.complete(ChatRequest(h, temperature=0.0, max_tokens=8))
                                           if isinstance(ev, Finished))))
    yield svc, h
    svc.close()


def evict(svc: ChatService) -> None:
    budget.enforce(svc.store.root, None, 0)
    for slot in svc._slots:
        slot.conv = None


def test_a_cold_rebuild_lets_other_conversations_proceed(cold: tuple[ChatService, list[Message]]) -> None:
    svc, h = cold
    evict(svc)
    asked = threading.Event()
    t_started: list[float] = []
    reply: list[str] = []

    def rebuild() -> None:
        def probe() -> bool:
            asked.set()  # first asked between two batches of the rebuild
            return False

        for ev in svc.complete(ChatRequest([*h, Message("user", "Name a city.")], temperature=0.0, max_tokens=8),
                               cancelled=probe):
            if isinstance(ev, Started):
                t_started.append(time.monotonic())
                assert ev.state == "disk" and ev.evaluated > 2000  # rebuilt whole
            elif isinstance(ev, Finished):
                reply.append(ev.text)

    t = threading.Thread(target=rebuild)
    t.start()
    assert asked.wait(300)
    other = [ev for ev in svc.complete(ChatRequest([Message("user", "Name a fruit.")], temperature=0.0, max_tokens=4))
             if isinstance(ev, Finished)]
    t_other = time.monotonic()
    t.join(300)
    assert other and t_started
    assert t_other < t_started[0]  # was: after the rebuild (it held the service's lock)
    h += [Message("user", "Name a city."), Message("assistant", reply[0])]  # the next test continues it


def test_a_client_that_leaves_stops_the_rebuild(cold: tuple[ChatService, list[Message]]) -> None:
    svc, h = cold
    evict(svc)
    conv = next(c for c in svc.store.ids() if len(svc.store.resolve(c).read_transcript().events) > 12)
    d = svc.store.resolve(conv)
    assert h[-2].content == "Name a city."  # the history ends at this conversation's end: a restore
    evals = [s.engine.n_evaluated_total for s in svc._slots]
    events = list(svc.complete(ChatRequest([*h, Message("user", "Name a town.")], temperature=0.0, max_tokens=8),
                               cancelled=lambda: True))
    assert events == []
    spent = sum(s.engine.n_evaluated_total for s in svc._slots) - sum(evals)
    assert spent < 1500  # one batch or so, not the whole history (was: all of it, then the reply skipped)
    assert not d.state_path.exists() or d.state_path.stat().st_size == 0  # nothing rewritten
    d.lock()  # not left locked
    d.unlock()
    # The next request rebuilds it and answers.
    done = [ev for ev in svc.complete(ChatRequest([*h, Message("user", "Name a town.")], temperature=0.0,
                                                  max_tokens=8)) if isinstance(ev, Finished)]
    assert done and (done[0].conversation, done[0].state) == (conv, "disk")



def test_the_batch_context_is_made_when_the_service_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Made lazily, the first two requests generating at once made it under the model's lock (0.15 s of CPU
    # for two contexts of the bundled model, 1.4 s for eight) while neither decoded: a benchmark's first run.
    s = isolated_session(tmp_path / "home", max_tokens=8, n_ctx=1024)
    try:
        svc = ChatService(s, parallel=2, index_path=tmp_path / "index.json")
        try:
            group = s.local_engine._group
            assert group is not None and group._ctx is not None and group.capacity == 2
            made: list[int] = []
            monkeypatch.setattr(group, "_make", lambda: made.append(1))
            start = threading.Barrier(2)
            done: list[Finished] = []

            def client(i: int) -> None:
                start.wait()
                req = ChatRequest([Message("user", f"Client {i}: count to twenty.")], temperature=0.0, max_tokens=16)
                done.extend(ev for ev in svc.complete(req) if isinstance(ev, Finished))

            th = [threading.Thread(target=client, args=(i,)) for i in range(2)]
            for t in th:
                t.start()
            for t in th:
                t.join(120)
            assert len(done) == 2 and not made
            assert group.scheduler.stats.largest == 2  # the two replies were decoded together, in that context
        finally:
            svc.close()
    finally:
        s.close()


def test_the_next_turn_is_matched_while_the_last_one_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One context: a client's next turn, sent right after [DONE], used to wait for the context before it was
    # even parsed and matched, i.e. for the previous turn's whole commit (its cells read out and written, the
    # metadata): now it finds its conversation meanwhile and waits only to take the context. It still
    # continues the conversation as recorded, from memory.
    s = isolated_session(tmp_path / "home", max_tokens=8, n_ctx=1024)
    svc = ChatService(s, parallel=1, index_path=tmp_path / "index.json")
    threads: list[threading.Thread] = []
    try:
        hold, committing, release = threading.Event(), threading.Event(), threading.Event()
        real_release = svc._release

        def held_release(conv: Conversation, rq: Any, **kw: Any) -> None:
            if hold.is_set():  # the reply's end is out (Finished): its commit is held here
                hold.clear()
                committing.set()
                assert release.wait(60)
            real_release(conv, rq, **kw)

        monkeypatch.setattr(svc, "_release", held_release)
        matched: list[int] = []
        real_lookup = svc.index.lookup
        monkeypatch.setattr(svc.index, "lookup", lambda *a, **k: (matched.append(1), real_lookup(*a, **k))[1])
        h = [Message("user", "Name a colour.")]
        done = [ev for ev in svc.complete(ChatRequest(h, temperature=0.0)) if isinstance(ev, Finished)]  # all of it
        first = done[0]
        h += [Message("assistant", first.text), Message("user", "And another?")]
        hold.set()
        second: list[Finished] = []
        t1 = threading.Thread(target=lambda: second.extend(
            ev for ev in svc.complete(ChatRequest(list(h), temperature=0.0)) if isinstance(ev, Finished)))
        t1.start()
        threads.append(t1)
        assert committing.wait(60)  # the second turn answered, its commit held
        assert second  # Finished came before the commit
        h += [Message("assistant", second[0].text), Message("user", "One more.")]
        n = len(matched)
        third: list[ServiceEvent] = []
        t2 = threading.Thread(target=lambda: third.extend(svc.complete(ChatRequest(list(h), temperature=0.0))))
        t2.start()
        threads.append(t2)
        deadline = time.monotonic() + 30
        while len(matched) == n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(matched) > n  # matched while the turn before still held the context
        assert not third  # nothing ran on the context meanwhile
        release.set()
        for t in threads:
            t.join(60)
        started = [ev for ev in third if isinstance(ev, Started)]
        assert started and started[0].conversation == first.conversation and started[0].state == "memory"
        assert any(isinstance(ev, Finished) for ev in third)
    finally:
        release.set()
        for t in threads:
            t.join(120)  # before the model goes
        svc.close()
        s.close()


def test_a_conversation_without_a_system_message_is_restored_not_evaluated_again(tmp_path: Path) -> None:
    # Its persona prefix is empty: saved as a record of no cells, which stopped every restore from disk (the
    # whole history evaluated again each time another conversation had taken its context).
    s = isolated_session(tmp_path / "home", max_tokens=12, n_ctx=1024)
    svc = ChatService(s, parallel=1, index_path=tmp_path / "index.json")
    try:
        hist = {0: [Message("user", "Name three rivers.")], 1: [Message("user", "Name two cities.")]}
        started: list[Started] = []
        for i in (0, 1, 0):
            evs = list(svc.complete(ChatRequest(hist[i], temperature=0.0)))
            started += [e for e in evs if isinstance(e, Started)]
            done = [e for e in evs if isinstance(e, Finished)]
            hist[i] += [Message("assistant", done[0].text), Message("user", "More?")]
        last = started[-1]
        assert last.state == "disk" and last.conversation == started[0].conversation
        assert last.evaluated < 20 and last.cached_tokens > 30  # the new message (and a closing), not the history
    finally:
        svc.close()
        s.close()
