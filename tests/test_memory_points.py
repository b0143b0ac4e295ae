"""Rollback points of memories that cannot be cut back, through the conversation (core/kv/log.py).

A hybrid memory's records each carry the recurrent state at their end; past HYBRID_POINTS the old ones are
merged into one record without it (NOT_A_POINT). These tests run llama.cpp's granitehybrid and deepseek4
fixtures with the bound set small, and prove on the real computation that resume, regenerate and undo still
match an uninterrupted or fresh evaluation while the file stops growing by a recurrent state per message.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chatcli.core.kv import log as kvlog
from chatcli.core.kv import records as sf
from tests.archs import ArchFixtures
from tests.drive import build_session, drain, say

MSGS = ["hello there", "second one", "a third", "and four", "five now", "six"]


def _session(model: Path) -> object:
    return build_session(model=str(model), n_ctx=256, reserve=16, max_tokens=6)


@pytest.mark.parametrize("arch", ["granitehybrid"])
def test_old_points_merge_and_everything_still_matches(arch_fixtures: ArchFixtures, arch: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Merge once more than 6 points are live, keeping 3: the newest exchange and the point before it.
    monkeypatch.setattr(kvlog, "HYBRID_POINTS", 3)
    sess = _session(arch_fixtures.path(arch))
    conv, _, _ = drain(sess.new_conversation("alice"))  # type: ignore[attr-defined]
    assert conv is not None and conv.backend.caps.memory == "hybrid"
    logits = []
    for m in MSGS[:5]:
        logits.append(say(conv, m)[1])
    state = sf.scan(conv.dir.state_path)
    flags = [r.flags for r in state.records if r.kind == sf.CELLS]
    assert flags[0] == sf.NOT_A_POINT and sum(r.is_point for r in state.records) <= 2 * 3
    cid = conv.id
    conv.close()
    # Resume in the same engine from the merged file: the next message's logits equal the uninterrupted run's.
    sess2 = _session(arch_fixtures.path(arch))
    whole, _, _ = drain(sess2.new_conversation("alice"))  # type: ignore[attr-defined]
    assert whole is not None
    want = [say(whole, m)[1] for m in MSGS]
    whole.close()
    assert all(np.array_equal(a, b) for a, b in zip(logits, want, strict=False))
    conv, report, _ = drain(sess.open_conversation(cid))  # type: ignore[attr-defined]
    assert conv is not None and report is not None and report.reevaluated == 0
    assert np.array_equal(say(conv, MSGS[5])[1], want[5])
    # Regenerate and undo of the newest exchange rewind to kept points: nothing re-evaluated.
    _, _, ends = drain(conv.regen())
    assert ends[-1].stats.reevaluated == 0
    assert conv.undo(1).reevaluated == 0
    assert np.array_equal(say(conv, MSGS[5])[1], want[5])
    # An undo past the kept points evaluates from the start, says so, and still equals a fresh evaluation.
    stats = conv.undo(4)
    assert stats.reevaluated and any("no saved state was left" in n.text for n in stats.notices)
    assert np.array_equal(say(conv, MSGS[2])[1], want[2])
    conv.close()
