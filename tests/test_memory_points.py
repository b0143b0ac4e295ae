"""Rollback points of memories that cannot be cut back, through the conversation (core/kv/log.py).

A hybrid memory's records each carry the recurrent state at their end; past HYBRID_POINTS the old ones are
merged into one record without it (NOT_A_POINT). These tests run llama.cpp's granitehybrid and deepseek4
fixtures with the bound set small, and prove on the real computation that resume, regenerate and undo still
match an uninterrupted or fresh evaluation while the file stops growing by a recurrent state per message.
An undo further back than the kept points rebuilds: the REPL shows it as /regen shows its rebuild.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from chatcli.core.kv import log as kvlog
from chatcli.core.kv import records as sf
from chatcli.repl.loop import Repl
from chatcli.repl.render import Renderer
from chatcli.repl.terminal import TerminalIO
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


LIVE = "\x1b[?25l"  # a live area starts (rich hides the cursor)
REBUILD = "rebuilding context from a saved point"
OTHER = "something else"


@pytest.mark.parametrize("arch", ["mamba", "granitehybrid", "llama"])
def test_repl_undo_shows_its_rebuild_and_ends_as_the_plain_undo_and_a_fresh_evaluation(
        arch_fixtures: ArchFixtures, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``/undo 3`` past the kept points (a recurrent memory keeps 2 whole states here, a hybrid one 1 point):
    the REPL draws the bar /regen draws, and the next reply is what ``Conversation.undo`` (the path without a
    bar) gives and what a fresh evaluation gives: tokens equal, logits bit-identical. An attention memory
    truncates: nothing is drawn."""
    monkeypatch.setattr(kvlog, "HYBRID_POINTS", 1)
    monkeypatch.setattr(kvlog, "WHOLE_POINTS", 2)
    sess = _session(arch_fixtures.path(arch))
    engine = sess.engine  # type: ignore[attr-defined]

    def new() -> object:
        conv, _, _ = drain(sess.new_conversation("alice"))  # type: ignore[attr-defined]
        assert conv is not None
        return conv

    plain = new()
    for m in MSGS[:4]:
        say(plain, m)  # type: ignore[arg-type]
    stats = plain.undo(3)  # type: ignore[attr-defined]
    want_reply, want_logits = say(plain, OTHER)  # type: ignore[arg-type]
    want_tokens = list(engine.tokens)
    plain.close()  # type: ignore[attr-defined]
    fresh = new()
    say(fresh, MSGS[0])  # type: ignore[arg-type]
    assert say(fresh, OTHER)[0] == want_reply and np.array_equal(fresh.turn_logits[1], want_logits)  # type: ignore[arg-type, attr-defined]
    assert list(engine.tokens) == want_tokens
    fresh.close()  # type: ignore[attr-defined]

    conv = new()
    for m in MSGS[:4]:
        say(conv, m)  # type: ignore[arg-type]
    out = io.StringIO()
    renderer = Renderer(Console(file=out, width=120, height=30, force_terminal=True, color_system=None,
                                highlight=False), err=io.StringIO())
    with create_pipe_input() as pipe:
        pipe.send_text(f"/undo 3\r{OTHER}\r\x04")
        Repl(sess, conv, renderer, lambda r: TerminalIO(r, input=pipe, output=DummyOutput())).run()  # type: ignore[arg-type]
    text = out.getvalue()
    undo = text[:text.index("undid 3 exchanges")]
    n = stats.reevaluated
    if engine.caps.truncate:
        assert n == 0 and REBUILD not in undo and " tok" not in undo  # a plain truncation: no bar
    else:
        assert n and undo.count(LIVE) == 1 and REBUILD in undo and f"{n}/{n} tok" in undo, undo
    assert re.search(rf"undid 3 exchanges: kept \d+ tokens, dropped \d+, re-evaluated {n}\b", text), text
    assert conv.messages[-1].tokens == want_reply and list(engine.tokens) == want_tokens  # type: ignore[attr-defined]
    assert np.array_equal(conv.turn_logits[1], want_logits)  # type: ignore[attr-defined]
