"""core/conversation.py policy on the fake backend (tests/fakes.py): turns, rollbacks, alternatives, edits,
undo/redo, context shifts, forks and resumes, over each memory the backends can have. No model: the set runs
in seconds (``pytest -m fast``). What the real engine adds, bit-identical logits, is tested in
tests/test_engine.py and tests/test_persistence.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chatcli.core.conversation import Conversation
from chatcli.core.events import ConversationError, MessageTooLongError, Notice
from chatcli.core.files.store import ConversationStore
from chatcli.core.forking import fork_conversation
from tests.fakes import (
    ALL_CAPS,
    CHECKPOINT_CAPS,
    EOS,
    HYBRID_CAPS,
    WHOLE_CAPS,
    FakeBackend,
    logits_for,
    new_conversation,
    open_again,
    say,
    text_tokens,
)

pytestmark = pytest.mark.fast

MEMORIES = {"cells": ALL_CAPS, "cells-no-shift": replace(ALL_CAPS, shift=False), "hybrid": HYBRID_CAPS,
            "whole": WHOLE_CAPS, "checkpoint": CHECKPOINT_CAPS}


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "conversations"


@pytest.fixture(params=list(MEMORIES))
def caps_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def consistent(conv: Conversation) -> list[int]:
    """The invariant every operation keeps: the context holds exactly the active messages' tokens, and the
    cells were computed from them. Returns the tokens."""
    eng = conv.backend
    assert isinstance(eng, FakeBackend)
    expected = list(conv.r.prefix_tokens) + [t for m in conv.r.active for t in m.tokens]
    assert eng.tokens == expected
    assert eng.kv == eng.tokens
    return list(eng.tokens)


def snapshot(conv: Conversation) -> tuple[Any, ...]:
    return (list(conv.backend.tokens), conv.dir.transcript_path.read_bytes(), [m.text for m in conv.messages])


def test_a_turn_is_the_template_difference_then_the_reply_and_its_closing(store_dir: Path) -> None:
    eng = FakeBackend()
    conv = new_conversation(eng, store_dir)
    prefix = list(eng.tokens)
    assert prefix == text_tokens("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert say(conv, "Hello", reply="Hi there") == "Hi there"
    reply = conv.messages[-1]
    # The reply owns its end-of-turn token and the template's closing ("\n" after <|im_end|>).
    assert reply.tokens == [*text_tokens("Hi there"), EOS, *text_tokens("\n")]
    assert eng.tokens[len(prefix):] == [*text_tokens("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"),
                                        *reply.tokens]
    consistent(conv)
    conv.close()


def test_regen_samples_from_the_saved_logits_and_keeps_the_old_reply(store_dir: Path, caps_name: str) -> None:
    eng = FakeBackend(caps=MEMORIES[caps_name])
    conv = new_conversation(eng, store_dir)
    say(conv, "Hello", reply="first")
    start = conv.messages[-1].p0
    n0 = eng.n_evaluated_total
    eng.queue("second")
    seen: list[np.ndarray] = []
    real_generate = eng.generate

    def spy(*a: Any, **kw: Any) -> Any:
        eng.ensure_logits()  # a memory without saved logits re-evaluates the last token (as generate would)
        seen.append(eng.logits())
        return real_generate(*a, **kw)

    eng.generate = spy  # type: ignore[method-assign]
    for _ in conv.regen():
        pass
    assert [m.text for m in conv.messages] == ["Hello", "second"]
    assert [(a.text, a.active) for a in conv.alternatives()] == [("first", False), ("second", True)]
    # Sampled from the logits of the reply's start: those saved with the user message, or (a memory without
    # logits) the ones re-evaluating its last token gives: equal by construction of the fake.
    assert np.array_equal(seen[0], logits_for(eng.tokens[:start]))
    sampled = len(conv.messages[-1].tokens)
    assert eng.n_evaluated_total - n0 == sampled + (0 if MEMORIES[caps_name].logits else 1)
    consistent(conv)
    conv.switch_alt(0)
    assert [m.text for m in conv.messages] == ["Hello", "first"]
    consistent(conv)
    conv.close()


def test_undo_then_redo_puts_back_the_same_tokens(store_dir: Path, caps_name: str) -> None:
    caps = MEMORIES[caps_name]
    eng = FakeBackend(caps=caps)
    conv = new_conversation(eng, store_dir)
    say(conv, "one", reply="uno")
    after_one = consistent(conv)
    say(conv, "two", reply="dos")
    after_two = consistent(conv)
    stats = conv.undo()
    assert consistent(conv) == after_one and stats.dropped == len(after_two) - len(after_one)
    loads, n0 = eng.loads, eng.n_evaluated_total
    stats = conv.redo()
    assert consistent(conv) == after_two
    if caps.cells:  # the cells come back from the state file: nothing evaluated
        assert stats.reevaluated == 0 and eng.n_evaluated_total == n0 and eng.loads > loads
    else:
        assert stats.reevaluated == len(after_two) - len(after_one)
    with pytest.raises(ConversationError):
        conv.redo()
    conv.close()


def test_edit_replaces_the_message_and_what_followed(store_dir: Path) -> None:
    eng = FakeBackend()
    conv = new_conversation(eng, store_dir)
    say(conv, "one", reply="uno")
    say(conv, "two", reply="dos")
    eng.queue("tres")
    for _ in conv.edit(1, "three"):
        pass
    assert [m.text for m in conv.messages] == ["three", "tres"]
    consistent(conv)
    conv.close()


def test_refusals_change_nothing(store_dir: Path) -> None:
    eng = FakeBackend(n_ctx=256)
    conv = new_conversation(eng, store_dir, reserve=16)
    say(conv, "one", reply="uno")
    before = snapshot(conv)
    refusals = {
        "undo of more than there is": lambda: conv.undo(2),
        "undo of nothing": lambda: conv.undo(0),
        "redo with nothing undone": lambda: conv.redo(),
        "alt that does not exist": lambda: conv.switch_alt(1),
        "edit of no message": lambda: list(conv.edit(2, "x")),
        "edit to empty text": lambda: list(conv.edit(1, "   ")),
    }
    for what, op in refusals.items():
        with pytest.raises(ConversationError):
            op()
        assert snapshot(conv) == before, what
    too_long: list[Callable[[], object]] = [lambda: list(conv.send("word " * 100)),
                                            lambda: list(conv.edit(1, "word " * 100))]
    for op in too_long:
        with pytest.raises(MessageTooLongError):
            op()
        assert snapshot(conv) == before
    assert say(conv, "still there?", reply="yes") == "yes"
    conv.close()


def _chat_until_shifted(conv: Conversation) -> list[Notice]:
    notices: list[Notice] = []
    for i in range(12):
        conv.backend.queue(f"answer number {i}")  # type: ignore[attr-defined]
        notices += [ev for ev in conv.send(f"question number {i}") if isinstance(ev, Notice)]
        if conv.r.out_of_context:
            return notices
    raise AssertionError("the context never filled")


def test_a_full_context_drops_the_oldest_exchanges_and_a_resume_continues_it(store_dir: Path, caps_name: str) -> None:
    caps = MEMORIES[caps_name]
    eng = FakeBackend(n_ctx=220, caps=caps)
    conv = new_conversation(eng, store_dir, reserve=16)
    notices = _chat_until_shifted(conv)
    tokens = consistent(conv)
    gone = [conv.r.all[mid]["text"] for mid in conv.r.out_of_context]
    assert gone[:2] == ["question number 0", "answer number 0"]  # the oldest whole exchange left first
    last_gone = int(gone[-1].rsplit(" ", 1)[1])
    assert gone[-1].startswith("answer") and conv.messages[0].text == f"question number {last_gone + 1}"
    if not caps.shift:
        assert any("cannot be shifted" in n.text for n in notices)
    cid = conv.id
    conv.close()
    eng.clear()
    n0 = eng.n_evaluated_total
    again, report = open_again(eng, store_dir, cid, reserve=16)
    assert consistent(again) == tokens
    if caps.cells:
        assert report.reevaluated == 0 and eng.n_evaluated_total == n0
    eng.queue("after the resume")
    assert say(again, "and now?") == "after the resume"
    consistent(again)
    again.close()


def test_the_same_conversation_on_every_memory_holds_the_same_tokens(tmp_path: Path) -> None:
    """How a memory shifts or restores is the backend's business; what the context holds is the policy's."""
    held = {}
    for name, caps in MEMORIES.items():
        eng = FakeBackend(n_ctx=220, caps=caps)
        conv = new_conversation(eng, tmp_path / name, reserve=16)
        _chat_until_shifted(conv)
        say(conv, "one more", reply="fine")
        held[name] = consistent(conv)
        conv.close()
    assert held["cells"] == held["cells-no-shift"] == held["checkpoint"]


def test_a_resumed_conversation_restores_without_evaluating(store_dir: Path, caps_name: str) -> None:
    caps = MEMORIES[caps_name]
    eng = FakeBackend(caps=caps)
    conv = new_conversation(eng, store_dir)
    say(conv, "one", reply="uno")
    tokens = consistent(conv)
    cid = conv.id
    conv.close()
    eng.clear()
    n0 = eng.n_evaluated_total
    again, report = open_again(eng, store_dir, cid)
    assert consistent(again) == tokens and report.reevaluated == 0 and eng.n_evaluated_total == n0
    again.close()


def test_a_damaged_state_file_is_rebuilt_from_the_transcript(store_dir: Path) -> None:
    eng = FakeBackend()
    conv = new_conversation(eng, store_dir)
    say(conv, "one", reply="uno")
    say(conv, "two", reply="dos")
    tokens = consistent(conv)
    cid, state = conv.id, conv.dir.state_path
    conv.close()
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    eng.clear()
    again, report = open_again(eng, store_dir, cid)
    assert consistent(again) == tokens and report.reevaluated > 0
    again.close()


def test_a_fork_starts_from_the_parents_first_exchanges_and_leaves_it_alone(store_dir: Path) -> None:
    eng = FakeBackend()
    conv = new_conversation(eng, store_dir)
    say(conv, "one", reply="uno")
    after_one = consistent(conv)
    say(conv, "two", reply="dos")
    parent = snapshot(conv)
    pid = conv.id
    conv.close()
    child_id, _ = fork_conversation(ConversationStore(store_dir), pid, 1)
    eng.clear()
    n0 = eng.n_evaluated_total
    child, report = open_again(eng, store_dir, child_id)
    assert [m.text for m in child.messages] == ["one", "uno"]
    assert consistent(child) == after_one and report.reevaluated == 0 and eng.n_evaluated_total == n0
    say(child, "other", reply="otro")
    child.close()
    eng.clear()
    conv, _ = open_again(eng, store_dir, pid)
    assert snapshot(conv)[1:] == parent[1:]
    conv.close()
