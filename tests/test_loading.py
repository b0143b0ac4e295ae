"""core/loading.py on the real model: creating uses the one persona prefix (a template that writes BOS
hits the warmed cache), and a failed open or create releases the conversation's lock."""

from __future__ import annotations

import dataclasses
import errno
from typing import Any, Iterator

import pytest

from chatcli.config.personas import get_persona
from chatcli.core.conversation import Conversation
from chatcli.core.events import Notice, Progress, ResumeReport
from chatcli.core.kv.log import CellLog
from chatcli.core.template import ChatTemplate
from chatcli.persona_prefixes import prefix_status, warm_prefix
from tests.golden import new_conv

N_CTX = 512
BASE_SESSION = {"threads": 2, "n_ctx": N_CTX, "max_tokens": 16}  # golden.base_session, this module's settings


def open_conv(session: Any, cid: str) -> tuple[Conversation, ResumeReport]:
    opening = session.open_conversation(cid)
    conv, report = opening.conversation, opening.report
    assert report is not None
    return conv, report


# -- one function makes the persona prefix tokens ---------------------------------------------------------

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
    opening = s.new_conversation("alice")
    events = list(opening)
    conv = opening.conversation
    try:
        assert eng.n_evaluated_total == before  # nothing evaluated: the warmed prefix was used
        assert any(isinstance(ev, Notice) and "loaded from cache" in ev.text for ev in events)
        # Exactly what the template writes, its own BOS included: no second BOS from the tokenizer.
        text = s.template.prefix(persona.messages())
        assert text.startswith(bos) and conv.r.prefix_tokens == eng.tokenize(text, add_special=False)
        assert list(eng.tokens) == conv.r.prefix_tokens
    finally:
        conv.close()


# -- a failed open or create releases the lock -------------------------------------------------------------


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
    real_restore = CellLog.restore

    def restore_with_progress(self: Any, *args: Any, **kw: Any) -> Any:
        yield Progress("restoring", 0, 1, 0.0)  # an event to stop at: a plain restore yields none
        return (yield from real_restore(self, *args, **kw))

    with monkeypatch.context() as mp:
        mp.setattr(CellLog, "restore", restore_with_progress)
        opening = sess.open_conversation(cid)
        assert isinstance(next(iter(opening)), Progress)  # an event came, the conversation not yet
        opening.close()
    conv, _ = open_conv(sess, cid)
    conv.close()


