"""core/opening.py: an Opening's events, then its conversation and report; stopped early, nothing stays locked."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from chatcli.core.backend import Sampling
from chatcli.core.events import ConversationError, Event, Notice, Progress, ResumeReport
from chatcli.core.files.store import ConversationStore, LockedError
from chatcli.core.kv.log import CellLog
from chatcli.core.loading import open_conversation
from chatcli.core.opening import Opening
from chatcli.core.template import ChatTemplate
from tests.fakes import IDENTITY, FakeBackend, new_conversation, open_again

pytestmark = pytest.mark.fast


def _steps(log: list[str]) -> Generator[Event, None, tuple[str, ResumeReport | None]]:
    log.append("started")
    yield Progress("loading", 1, 2, 0.0)
    yield Notice("halfway")
    log.append("finished")
    return "the conversation", ResumeReport(restored_tokens=3)


def test_events_first_then_the_conversation_and_its_report() -> None:
    log: list[str] = []
    opening = Opening(_steps(log))
    assert log == []  # nothing runs before it is asked for
    events = list(opening)
    assert [type(e) for e in events] == [Progress, Notice] and log == ["started", "finished"]
    assert opening.conversation == "the conversation"
    assert opening.report is not None and opening.report.restored_tokens == 3


def test_asking_for_the_conversation_runs_the_events_unseen() -> None:
    log: list[str] = []
    opening = Opening(_steps(log))
    assert opening.conversation == "the conversation" and log == ["started", "finished"]
    assert list(opening) == []  # single use: they ran


def test_before_and_then_add_events_around_it_in_order() -> None:
    opening = Opening(_steps([])).before([Notice("first")]).then(lambda c: [Notice(f"after {c}")])
    assert [getattr(e, "text", "progress") for e in opening] == ["first", "progress", "halfway",
                                                                 "after the conversation"]
    assert opening.conversation == "the conversation"


def test_a_stopped_opening_has_no_conversation() -> None:
    opening = Opening(_steps([]))
    next(iter(opening))
    opening.close()
    with pytest.raises(ConversationError, match="could not be opened"):
        opening.conversation  # noqa: B018  # the property is what is tested


def test_stopping_an_open_before_its_end_releases_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = FakeBackend()
    store_dir = tmp_path / "conversations"
    conv = new_conversation(eng, store_dir)
    cid = conv.id
    conv.close()
    real_restore = CellLog.restore

    def restore_with_progress(self: CellLog, *args: object, **kw: object) -> Generator[Event, None, None]:
        yield Progress("restoring", 0, 1, 0.0)  # an event to stop at: a plain restore yields none
        yield from real_restore(self, *args, **kw)  # type: ignore[arg-type]

    eng.clear()
    with monkeypatch.context() as mp:
        mp.setattr(CellLog, "restore", restore_with_progress)
        opening = open_conversation(ConversationStore(store_dir), cid, eng, ChatTemplate(None), identity=IDENTITY,
                                    sampling=Sampling())
        assert isinstance(next(iter(opening)), Progress)
        held = ConversationStore(store_dir).resolve(cid)
        with pytest.raises(LockedError):
            held.lock()  # the opening holds it while it runs
        opening.close()
    eng.clear()
    again, _ = open_again(eng, store_dir, cid)  # not left locked
    again.close()
