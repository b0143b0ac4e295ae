"""core/steps.py: the one evaluate-with-progress loop and the one drain of events (on the fake backend)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatcli.core.backend import Sampling
from chatcli.core.events import Progress, ReplyEnd
from chatcli.core.files.store import ConversationStore
from chatcli.core.loading import create_conversation, open_conversation
from chatcli.core.steps import drain, evaluate, progress
from chatcli.core.template import ChatTemplate
from tests.fakes import IDENTITY, PERSONA, FakeBackend, new_conversation

pytestmark = pytest.mark.fast


def test_evaluate_yields_a_progress_per_batch_and_returns_the_seconds() -> None:
    backend = FakeBackend(n_batch=4)
    gen = evaluate(backend, list(range(10)), "reading", stoppable=True)
    seen = []
    while True:
        try:
            seen.append(next(gen))
        except StopIteration as stop:
            seconds = stop.value
            break
    assert [(p.label, p.done, p.total, p.stoppable) for p in seen] == [
        ("reading", 4, 10, True), ("reading", 8, 10, True), ("reading", 10, 10, True)]
    assert all(isinstance(p, Progress) for p in seen)
    assert [p.seconds for p in seen] == sorted(p.seconds for p in seen) and 0 <= seen[-1].seconds <= seconds
    assert backend.tokens == list(range(10))


def test_evaluate_shows_nothing_at_or_below_above_but_still_evaluates() -> None:
    backend = FakeBackend(n_batch=4)
    assert list(evaluate(backend, [1, 2, 3], "reading", above=3)) == []
    assert backend.tokens == [1, 2, 3]


def test_progress_counts_from_since() -> None:
    (only,) = list(progress([(1, 1)], "rebuilding", since=0.0))
    assert only.seconds > 1.0  # perf_counter() since its epoch, not since the step


def test_drain_of_an_opening_gives_its_conversation_report_and_notices(tmp_path: Path) -> None:
    backend = FakeBackend()
    conv = new_conversation(backend, tmp_path)
    conv.close()
    backend.clear()
    opened = drain(open_conversation(ConversationStore(tmp_path), conv.id, backend, ChatTemplate(None),
                                     identity=IDENTITY, sampling=Sampling(temperature=0.0)))
    assert opened.conversation is not None and opened.conversation.id == conv.id
    assert opened.report is not None and opened.report.restored_tokens == backend.n_past > 0
    assert opened.ends == [] and not opened.stopped
    opened.conversation.close()


def test_drain_of_an_operation_keeps_the_reply_ends(tmp_path: Path) -> None:
    backend = FakeBackend()
    conv = new_conversation(backend, tmp_path)
    backend.queue("hello there")
    done = drain(conv.send("hi"))
    assert done.conversation is None and done.report is None
    assert [type(e) for e in done.ends] == [ReplyEnd] and done.ends[0].message.text == "hello there"


def test_drain_stopped_at_a_progress_closes_the_opening_and_releases_its_lock(tmp_path: Path) -> None:
    backend = FakeBackend(n_batch=2)  # the persona prefix takes several batches: several Progress events
    asked = []

    def stop() -> bool:
        asked.append(1)
        return True

    store = ConversationStore(tmp_path)
    opening = create_conversation(
        store, backend, ChatTemplate(None), persona_name="fake", persona_messages=list(PERSONA),
        persona_hash="p", identity=IDENTITY, model_path="fake.gguf", sampling=Sampling(temperature=0.0), seed=1)
    done = drain(opening, stop=stop)
    assert done.stopped and asked == [1] and done.conversation is None
    (cdir,) = [store.resolve(p.name) for p in tmp_path.iterdir() if p.is_dir()]
    cdir.lock()  # released by the stop: this would raise LockedError otherwise
    cdir.unlock()
