"""bench/faults.py's crash harness in the suite: SIGKILL at chosen points loses at most the reply in flight.

The promises are listed in docs/PROMISES.md; `python bench/faults.py` runs many more kill points."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.golden import faults

# The shared fixtures (sess, golden: tests/golden.py, a plugin of tests/conftest.py), on one llama.cpp thread.
pytestmark = pytest.mark.usefixtures("one_thread")


# bench/faults.py's session without its last line: it still compacts and shifts, a little faster.
CRASH_SCRIPT = faults.SCRIPT[:-1]


@pytest.fixture(scope="module")
def fault_ref(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The scripted session, uninterrupted (with turns, /undo compaction and a context shift)."""
    return faults.reference(tmp_path_factory.mktemp("faults"), CRASH_SCRIPT)


KILL_POINTS = {
    # SIGKILL half-way through appending the cells of the second reply: a torn state record.
    "torn-state-append": ("write:state", "torn", "message:assistant", 2, 0),
    # SIGKILL while the third reply streams, after five decodes.
    "mid-reply": ("decode", "before", "message:user", 3, 5),
    # SIGKILL half-way through writing the compacted state file (temp file of an atomic rewrite): the reply to
    # the question after /undo made the undone turn's cells dead, and they outweigh the live ones.
    "mid-compaction": ("write:state_tmp", "torn", "message:assistant", 2, 0),
    # SIGKILL after the second /undo's transcript event, before its state records: the state file still holds
    # the compacted snapshot the undo cuts into.
    "undo-into-snapshot": ("write:state", "before", "truncate:undo", 2, 0),
    # SIGKILL after the oldest exchange left the context, before the snapshot that follows it is written.
    "after-shift": ("shift", "after", "shift:", 1, 0),
}  # (torn transcript lines: bench/faults.py and test_torn_last_transcript_line_is_dropped_reported_and_repaired)


@pytest.mark.parametrize("name", list(KILL_POINTS))
def test_sigkill_loses_at_most_the_reply_in_flight(name: str, fault_ref: Any, tmp_path: Path) -> None:
    event, phase, note, k, skip = KILL_POINTS[name]
    if event == "shift":
        point = faults.KillPoint(f"shift #1 {phase}", {"event": "shift", "n": 1, "phase": phase})
    else:
        point = faults.point_after(fault_ref, event, phase, note, k, skip)
    if name == "mid-compaction":
        # The point is found by position in the session: make sure it still is a compaction (a change to
        # what compacts when would otherwise move it silently onto another rewrite).
        assert "(compaction)" in point.label, point.label
    out = faults.run_point(fault_ref, point, tmp_path, CRASH_SCRIPT)
    assert out.killed, point.label
    assert out.problems == [], (point.label, out.problems)
    assert out.lost == 0
    if name == "mid-reply":
        # Five tokens into the reply, its user message's cells were not written yet (they go with the reply's,
        # or after conversation.LATE_SAVE_SECONDS): the resume evaluated the message again, from the transcript.
        assert not out.intact and out.identical, point.label
    if name in ("mid-compaction", "undo-into-snapshot"):
        # The state on disk was complete for everything the transcript holds: restored, not re-evaluated,
        # and the conversation continues exactly as if it had never been killed.
        assert out.intact and out.identical, point.label
    if name == "torn-state-append":
        assert not out.intact  # the torn record was detected and its cells re-evaluated


def test_remaining_lines_after_a_kill(fault_ref: Any) -> None:
    """The harness itself: which scripted lines a resume must still send."""
    script = CRASH_SCRIPT
    assert faults.remaining_lines(fault_ref, script, 0) == (script, False)
    first_user_only = fault_ref.line_spans[0][0] + 1
    assert faults.remaining_lines(fault_ref, script, first_user_only) == (script[1:], True)
    assert faults.remaining_lines(fault_ref, script, len(fault_ref.events)) == ([], False)


# A compaction, then an /undo that cuts into its snapshot (saving the part cut as a SPARE record), then /redo.
SPARE_SCRIPT = [faults.SCRIPT[0], "/undo", faults.SHORT_QUESTION, "/undo", "/redo", "And what is the capital of Italy?"]
SPARE_POINTS = {
    # Each phase of the compaction after the short question's reply (the undone long turn's cells are dropped).
    **{f"compaction-{ev}-{ph}": (ev, ph, "message:assistant", 2, 0)
       for ev, phases in (("write:state_tmp", ("before", "torn", "after")), ("replace:state", ("before", "after")))
       for ph in phases},
    # Each phase of the second /undo's append: its SPARE record, then its TRUNCATE (one write each).
    **{f"undo-append-{rec}-{ph}": ("write:state", ph, "truncate:undo", 2, skip)
       for skip, rec in enumerate(("spare", "truncate")) for ph in ("before", "torn", "after")},
}


@pytest.fixture(scope="module")
def spare_ref(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return faults.reference(tmp_path_factory.mktemp("faults-spare"), SPARE_SCRIPT, shift=False)


@pytest.mark.parametrize("name", list(SPARE_POINTS))
def test_sigkill_in_a_compaction_or_an_undo_keeps_what_redo_reads_back(name: str, spare_ref: Any,
                                                                        tmp_path: Path) -> None:
    """A kill anywhere in a compaction, or in an /undo that cuts into the snapshot a compaction wrote,
    leaves the state as before or as after it: the resume evaluates nothing, the /redo after it reads the
    undone cells back (evaluates nothing), and the conversation continues as if never killed."""
    event, phase, note, k, skip = SPARE_POINTS[name]
    point = faults.point_after(spare_ref, event, phase, note, k, skip)
    if name.startswith("compaction-"):
        assert "(compaction)" in point.label, point.label
    out = faults.run_point(spare_ref, point, tmp_path, SPARE_SCRIPT)
    assert out.killed, point.label
    assert out.problems == [], (point.label, out.problems)
    assert out.lost == 0
    assert out.intact and out.identical, point.label
    assert "redone 1 exchange: 0 tokens evaluated" in out.resume_stderr, (point.label, out.resume_stderr[-800:])


# The /redo of SPARE_SCRIPT brings back two messages (one activate event each) whose cells one SPARE record
# holds: a kill between the two events, or in the append of the REVIVE record after them.
REDO_POINTS = {
    **{f"redo-between-events-{ph}": ("write:transcript", ph, "activate:", 1, 0) for ph in ("before", "torn")},
    **{f"redo-revive-append-{ph}": ("write:state", ph, "activate:", 2, 0) for ph in ("before", "torn", "after")},
}


@pytest.mark.parametrize("name", list(REDO_POINTS))
def test_sigkill_in_a_redo_finishes_it_on_resume_reading_the_cells_back(name: str, spare_ref: Any,
                                                                        tmp_path: Path) -> None:
    """A /redo is whole or not at all: killed between its transcript events (the user message would be left
    without its reply), the resume appends the rest of them. Killed before its REVIVE record is whole, the
    resume reads the redone cells back as the /redo would have. Either way nothing is evaluated and the
    conversation continues as if never killed."""
    event, phase, note, k, skip = REDO_POINTS[name]
    point = faults.point_after(spare_ref, event, phase, note, k, skip)
    out = faults.run_point(spare_ref, point, tmp_path, SPARE_SCRIPT)
    assert out.killed, point.label
    assert out.problems == [], (point.label, out.problems)
    assert out.lost == 0
    assert out.intact and out.identical, (point.label, out.resume_stderr[-800:])
    torn = name.startswith("redo-between-events")
    assert ("the last /redo was interrupted" in out.resume_stderr) == torn, out.resume_stderr[-800:]
