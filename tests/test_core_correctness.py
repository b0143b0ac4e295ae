"""Issue #11 items 1, 3, 6, 7 on the real model: refusals change nothing, one persona prefix everywhere,
a failed open releases its lock, a failed state write is reported when it happens."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from chatcli.config.personas import get_persona
from chatcli.core.conversation import Conversation
from chatcli.core.events import ConversationError, MessageTooLongError, Notice, ReplyEnd, ResumeReport
from chatcli.core.forking import fork_conversation
from chatcli.core.kv.log import CellLog
from chatcli.core.template import ChatTemplate
from chatcli.persona_prefixes import prefix_status, warm_prefix

N_CTX = 512


@pytest.fixture(scope="module")
def base_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.drive import isolated_session

    session = isolated_session(tmp_path_factory.mktemp("base") / "home", threads=2, n_ctx=N_CTX, max_tokens=16, reserve=64)
    yield session
    session.close()


@pytest.fixture
def sess(base_session: Any, chatcli_home: Path) -> Any:
    """The module's session (its engine) bound to this test's CHATCLI_HOME."""
    from tests.drive import rebind

    return rebind(base_session)


def new_conv(session: Any, *msgs: str) -> Conversation:
    events = list(session.new_conversation("alice"))
    conv = events[-1]
    assert isinstance(conv, Conversation)
    for m in msgs:
        assert any(isinstance(ev, ReplyEnd) for ev in conv.send(m))
    return conv


def open_conv(session: Any, cid: str) -> tuple[Conversation, ResumeReport]:
    events = list(session.open_conversation(cid))
    conv, report = events[-1], events[-2]
    assert isinstance(conv, Conversation) and isinstance(report, ResumeReport)
    return conv, report


def snapshot(conv: Conversation) -> tuple[Any, ...]:
    """Everything a refused operation must leave alone."""
    return (
        [(m.mid, m.role, m.text, tuple(m.tokens), m.p0) for m in conv.messages],
        conv.context.n_past, list(conv.engine.tokens), [list(x) for x in conv.r.redo],
        conv.dir.transcript_path.read_bytes(), conv.dir.state_path.read_bytes(), conv.dir.meta_path.read_bytes(),
    )


# -- 1: every rollback operation validates first ---------------------------------------------------------


def test_refused_rollbacks_change_nothing(sess: Any) -> None:
    conv = new_conv(sess, "Hi, who are you?", "Name a colour.")
    try:
        before = snapshot(conv)
        refusals = {
            "edit too long for the context": lambda: list(conv.edit(1, "word " * 600)),
            "edit of the last message too long": lambda: list(conv.edit(None, "word " * 600)),
            "edit of a message that does not exist": lambda: list(conv.edit(3, "hello")),
            "edit of message 0": lambda: list(conv.edit(0, "hello")),
            "edit to empty text": lambda: list(conv.edit(1, "   ")),
            "undo of nothing": lambda: conv.undo(0),
            "undo of more than there is": lambda: conv.undo(3),
            "redo with nothing undone": lambda: conv.redo(),
            "alt that does not exist": lambda: conv.switch_alt(1),
            "alt -1": lambda: conv.switch_alt(-1),
        }
        for what, op in refusals.items():
            with pytest.raises(ConversationError):
                op()
            assert snapshot(conv) == before, what
        # A refused fork creates nothing and leaves the parent alone.
        ids = sess.store.ids()
        with pytest.raises(ConversationError):
            fork_conversation(sess.store, conv.id, 5)
        assert sess.store.ids() == ids and snapshot(conv) == before
        # Refused, yet usable: a real edit still works afterwards, and an undo can be redone.
        assert any(isinstance(ev, ReplyEnd) for ev in conv.edit(2, "Name a fruit."))
        conv.undo()
        undone = snapshot(conv)
        with pytest.raises(MessageTooLongError):
            list(conv.edit(1, "word " * 600))
        assert snapshot(conv) == undone  # the redo stack survived the refusal
        conv.redo()
        assert [m.role for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    finally:
        conv.close()
    empty = new_conv(sess)
    try:
        before = snapshot(empty)
        with pytest.raises(ConversationError):
            list(empty.regen())
        with pytest.raises(ConversationError):
            list(empty.edit(None, "hello"))
        assert snapshot(empty) == before
    finally:
        empty.close()


# -- 3: one function makes the persona prefix tokens -------------------------------------------------------

# A crafted template that writes BOS itself, as Llama 3, Mistral and Gemma instruct templates do.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class BosVocab:
    """The real engine with a vocabulary that asks for BOS (SmolLM2's does not): ``tokenize`` with
    ``add_special`` prepends BOS, as llama.cpp does for such a model."""

    def __init__(self, engine: Any) -> None:
        self._e = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._e, name)

    @property
    def add_bos(self) -> bool:
        return True

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        toks = self._e.tokenize(text, add_special=False, parse_special=parse_special)
        return [self._e.bos_token, *toks] if add_special else toks


def test_template_with_bos_warm_then_create_hits_the_cache(sess: Any) -> None:
    eng = sess.engine
    bos = eng.piece(eng.bos_token).decode()
    s = dataclasses.replace(sess, engine=BosVocab(eng), template=ChatTemplate(BOS_TEMPLATE, bos_token=bos))
    persona = get_persona("alice", s.paths.personas_dir)
    assert prefix_status(s.settings, s.paths, persona, s) == "not cached"
    list(warm_prefix(s, persona))
    assert prefix_status(s.settings, s.paths, persona, s) == "cached"
    before = eng.n_evaluated_total
    events = list(s.new_conversation("alice"))
    conv = events[-1]
    assert isinstance(conv, Conversation)
    try:
        assert eng.n_evaluated_total == before  # nothing evaluated: the warmed prefix was used
        assert any(isinstance(ev, Notice) and "loaded from cache" in ev.text for ev in events)
        # Exactly what the template writes, its own BOS included: no second BOS from the tokenizer.
        text = s.template.prefix(persona.messages())
        assert text.startswith(bos) and conv.r.prefix_tokens == eng.tokenize(text, add_special=False)
        assert list(eng.tokens) == conv.r.prefix_tokens
    finally:
        conv.close()


# -- 6: a failed open or create releases the lock -----------------------------------------------------------


def test_failed_open_or_create_releases_the_lock(sess: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    conv = new_conv(sess, "Hi!")
    cid = conv.id
    conv.close()

    def broken(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        raise OSError(errno.EIO, "simulated read error")
        yield  # a generator, like the real one

    with monkeypatch.context() as mp:
        mp.setattr(CellLog, "restore", broken)
        with pytest.raises(OSError, match="simulated"):
            open_conv(sess, cid)
    with open_conv(sess, cid)[0] as conv:  # not locked out by the failed attempt
        assert conv.id == cid
    # ``with`` released it too.
    conv, _ = open_conv(sess, cid)
    conv.close()

    ids = set(sess.store.ids())
    with monkeypatch.context() as mp:
        mp.setattr(CellLog, "start", broken)
        with pytest.raises(OSError, match="simulated"):
            list(sess.new_conversation("alice"))
    (half_made,) = set(sess.store.ids()) - ids
    conv, _ = open_conv(sess, half_made)  # it opens (and rebuilds its state): not left locked
    assert list(conv.engine.tokens) == conv.r.prefix_tokens
    conv.close()

    # A consumer that stops reading before it gets the conversation leaves it unlocked too.
    events = sess.open_conversation(cid)
    next(ev for ev in events if isinstance(ev, ResumeReport))
    events.close()
    conv, _ = open_conv(sess, cid)
    conv.close()


# -- 7: a failed state write is a Notice when it happens -----------------------------------------------------


class StateDiskFull:
    """os.write failing with ENOSPC for the state file (and its temp files during a rewrite)."""

    def __init__(self) -> None:
        self.real = os.write
        self.failures = 0

    def __call__(self, fd: int, data: Any) -> int:
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            name = ""
        if name == "state.kv" or (name.startswith(".state.kv.") and name.endswith(".tmp")):
            self.failures += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(fd, data)


def _warned(items: list[Any]) -> bool:
    return any(isinstance(n, Notice) and "could not save" in n.text and n.level == "warn" for n in items)


def test_failed_state_write_is_reported_by_the_operation_that_hit_it(
    sess: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    conv = new_conv(sess, "Hi, who are you?")
    try:
        assert any(isinstance(ev, ReplyEnd) for ev in conv.regen())  # two alternatives to switch between
        full = StateDiskFull()
        with monkeypatch.context() as mp:
            mp.setattr(os, "write", full)
            events = list(conv.send("Name a colour."))
            assert _warned(events)
            # Said before the reply ends, not at some later reply.
            first = next(i for i, ev in enumerate(events) if isinstance(ev, Notice) and "could not save" in ev.text)
            assert first < next(i for i, ev in enumerate(events) if isinstance(ev, ReplyEnd))
            assert _warned(conv.undo().notices)
            assert _warned(conv.redo().notices)
            assert _warned(list(conv.regen()))
            assert _warned(conv.switch_alt(0).notices)
            assert _warned(list(conv.edit(None, "Name a fruit.")))
        assert full.failures >= 6
        # The disk has room again: the next operation saves, and says nothing.
        stats = conv.undo()
        assert stats.notices == [] and conv.save_error == ""
        assert list(conv.engine.tokens) == conv.r.tokens()
    finally:
        conv.close()
    conv, _ = open_conv(sess, conv.id)
    assert list(conv.engine.tokens) == conv.r.tokens()
    conv.close()
