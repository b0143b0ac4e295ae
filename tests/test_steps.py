"""core/steps.py: the one evaluate-with-progress loop, the guard for evaluation that cannot stop halfway and
the one drain of events (on the fake backend)."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from chatcli.core.backend import Capabilities, Sampling
from chatcli.core.conversation import Conversation
from chatcli.core.events import ConversationError, Progress, ReplyEnd, ReplyStart, TurnStats
from chatcli.core.files.store import ConversationStore
from chatcli.core.kv import log as kvlog
from chatcli.core.loading import create_conversation, open_conversation
from chatcli.core.steps import drain, evaluate, finish, progress, to_the_end
from chatcli.core.template import ChatTemplate
from tests.fakes import (
    ALL_CAPS,
    HYBRID_CAPS,
    IDENTITY,
    PERSONA,
    WHOLE_CAPS,
    FakeBackend,
    new_conversation,
    open_again,
    say,
)

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


def test_to_the_end_passes_progress_on_and_finishes_when_closed_early() -> None:
    plain, guarded = FakeBackend(n_batch=4), FakeBackend(n_batch=4)
    gen = evaluate(plain, list(range(10)), "reading")
    assert next(gen).done == 4
    gen.close()
    assert plain.tokens == [0, 1, 2, 3]  # what the guard is for: a closed evaluation stops halfway
    steps = to_the_end(evaluate(guarded, list(range(10)), "rebuilding"))
    first = next(steps)
    assert (first.label, first.done, first.total) == ("rebuilding", 4, 10)
    steps.close()
    assert guarded.tokens == list(range(10))
    again = FakeBackend(n_batch=4)
    assert finish(to_the_end(evaluate(again, [1, 2, 3], "x"))) >= 0 and again.tokens == [1, 2, 3]


def _merged_hybrid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caps: Capabilities = HYBRID_CAPS,
                   ) -> tuple[FakeBackend, Conversation]:
    """A conversation on a memory that cannot be cut back whose early points were merged away (one point
    kept), so going back to its first message rebuilds the persona prefix from the start."""
    monkeypatch.setattr(kvlog, "HYBRID_POINTS", 1)
    backend = FakeBackend(n_batch=4, caps=caps)
    conv = new_conversation(backend, tmp_path)
    for i in range(4):
        say(conv, f"message {i}", reply=f"reply {i}")
    return backend, conv


REBUILD = "rebuilding context from a saved point"


def test_an_edit_that_rebuilds_from_a_saved_point_reports_each_batch(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    backend, conv = _merged_hybrid(tmp_path, monkeypatch)
    p0 = conv.user_messages()[0].p0
    backend.queue("new reply")
    events = list(conv.edit(1, "changed"))
    bars = [e for e in events if isinstance(e, Progress) and e.label == REBUILD]
    start = next(i for i, e in enumerate(events) if isinstance(e, ReplyStart))
    assert len(bars) >= p0 // 4 and all(events.index(b) < start for b in bars), bars
    assert bars[-1].done == bars[-1].total == p0 and not any(b.stoppable for b in bars)
    assert conv.messages[-1].text == "new reply" and backend.kv == backend.tokens


def test_closed_during_that_rebuild_the_context_is_not_left_halfway(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    backend, conv = _merged_hybrid(tmp_path, monkeypatch)
    p0 = conv.user_messages()[0].p0
    before = list(backend.tokens)
    events = conv.edit(1, "changed")
    for ev in events:
        if isinstance(ev, Progress) and ev.label == REBUILD:
            assert ev.done < ev.total
            break
    events.close()  # a client that went away, a rendering error
    assert backend.tokens == before[:p0] and backend.kv == backend.tokens
    assert say(conv, "after", reply="still whole") == "still whole"
    conv.close()
    backend.clear()
    again, report = open_again(backend, tmp_path, conv.id)
    assert [m.text for m in again.messages] == ["after", "still whole"] and report.reevaluated == 0


# -- /undo, /redo and /alt: the same rollbacks, their progress reported ---------------------------------------

PUT_BACK = kvlog.PUT_BACK


def _run(steps: Generator[Progress, None, TurnStats]) -> tuple[list[Progress], TurnStats]:
    """Every event of ``steps`` and its value."""
    events = []
    while True:
        try:
            events.append(next(steps))
        except StopIteration as stop:
            return events, stop.value


def _same(a: Conversation, b: Conversation, sa: TurnStats, sb: TurnStats) -> None:
    assert (sa.kept, sa.dropped, sa.reevaluated, sa.n_eval) == (sb.kept, sb.dropped, sb.reevaluated, sb.n_eval)
    assert [n.text for n in sa.notices] == [n.text for n in sb.notices]
    ba, bb = a.backend, b.backend
    assert isinstance(ba, FakeBackend) and isinstance(bb, FakeBackend)
    assert ba.tokens == bb.tokens and ba.kv == bb.kv and ba.kv == ba.tokens
    assert [(m.role, m.text, m.tokens, m.p0) for m in a.messages] == [(m.role, m.text, m.tokens, m.p0) for m in b.messages]
    ma, mb = a.dir.read_meta(), b.dir.read_meta()
    assert (ma["turns"], ma["tokens"]) == (mb["turns"], mb["tokens"])


@pytest.mark.parametrize("caps", [HYBRID_CAPS, WHOLE_CAPS, ALL_CAPS], ids=lambda c: c.memory)
def test_undo_redo_and_alt_steps_report_what_they_evaluate_and_end_as_the_plain_forms(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caps: Capabilities) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, shown = _merged_hybrid(tmp_path / "a", monkeypatch, caps)
    _, plain = _merged_hybrid(tmp_path / "b", monkeypatch, caps)
    ops = [("undo", lambda c: c.undo_steps(4), lambda c: c.undo(4)),
           ("redo", lambda c: c.redo_steps(), lambda c: c.redo()),
           ("alt", lambda c: c.switch_alt_steps(0), lambda c: c.switch_alt(0)),
           ("alt", lambda c: c.switch_alt_steps(1), lambda c: c.switch_alt(1)),
           ("alt", lambda c: c.switch_alt_steps(1), lambda c: c.switch_alt(1))]  # already active: nothing
    seen = {}
    for i, (name, steps, finished) in enumerate(ops):
        if i == 2:
            for c in (shown, plain):
                c.backend.queue("another reply")  # type: ignore[attr-defined]
                drain(c.regen())
        events, stats = _run(steps(shown))
        _same(shown, plain, stats, finished(plain))
        evaluated = (stats.reevaluated or 0) + stats.n_eval if name != "redo" else stats.n_eval
        # A bar exactly when something is evaluated: a plain truncation or cells read back show nothing.
        assert bool(events) == bool(evaluated), (name, events, stats)
        assert all(isinstance(e, Progress) and not e.stoppable for e in events)
        ends = {e.label: e for e in events}  # each bar's last step
        assert set(ends) <= {REBUILD, PUT_BACK} and all(e.done == e.total for e in ends.values())
        assert sum(e.total for e in ends.values()) == evaluated  # the bars count what the stats say
        seen[i] = events
    if caps.memory == "hybrid":  # the points were merged away: every rollback here rebuilds
        assert seen[0] and seen[1] and seen[2]
        # The other reply is read back from its kept (SPARE) cells: only the rollback before it rebuilds.
        assert {e.label for e in seen[0]} == {REBUILD} and {e.label for e in seen[2]} == {REBUILD}
    if caps.memory == "attention":
        assert not seen[0]  # an undo is a truncation
    assert not seen[4]


def test_a_refused_undo_redo_or_alt_raises_at_the_call_and_changes_nothing(tmp_path: Path) -> None:
    backend = FakeBackend(n_batch=4, caps=HYBRID_CAPS)
    conv = new_conversation(backend, tmp_path)
    say(conv, "hello", reply="hi")
    before = (conv.dir.transcript_path.read_bytes(), conv.dir.state_path.read_bytes(), list(backend.tokens))
    for refused in (lambda: conv.undo_steps(2), lambda: conv.undo_steps(0), conv.redo_steps,
                    lambda: conv.switch_alt_steps(1)):
        with pytest.raises(ConversationError):
            refused()  # at the call, before a bar could be shown
    conv.undo_steps(1).close()  # never iterated: nothing done
    assert (conv.dir.transcript_path.read_bytes(), conv.dir.state_path.read_bytes(), list(backend.tokens)) == before
    assert [m.text for m in conv.messages] == ["hello", "hi"]


@pytest.mark.parametrize("op", ["undo", "alt"])
def test_closed_during_its_rebuild_an_undo_or_alt_still_finishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 op: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ba, closed = _merged_hybrid(tmp_path / "a", monkeypatch)
    _, plain = _merged_hybrid(tmp_path / "b", monkeypatch)
    if op == "alt":
        for c in (closed, plain):
            c.undo(4)  # the points merged again after the redo: the alt below rebuilds
            c.redo()
            c.backend.queue("another reply")  # type: ignore[attr-defined]
            drain(c.regen())
    steps = closed.undo_steps(4) if op == "undo" else closed.switch_alt_steps(0)
    first = next(steps)
    assert first.label == REBUILD and first.done < first.total  # stopped halfway through the rebuild...
    steps.close()  # ...by a Ctrl-C'd or failed rendering
    stats = plain.undo(4) if op == "undo" else plain.switch_alt(0)
    # ...and yet all of it happened: the rebuild, the reply brought back, the metadata written.
    assert ba.tokens == plain.backend.tokens and ba.kv == ba.tokens  # type: ignore[attr-defined]
    assert [m.text for m in closed.messages] == [m.text for m in plain.messages]
    assert closed.dir.read_meta()["tokens"] == plain.dir.read_meta()["tokens"] == len(plain.backend.tokens) >= (stats.kept or 0)
    cid = closed.id
    closed.close()
    ba.clear()
    again, report = open_again(ba, tmp_path / "a", cid)
    assert [m.text for m in again.messages] == [m.text for m in plain.messages] and report.reevaluated == 0
