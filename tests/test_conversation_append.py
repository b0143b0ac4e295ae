"""The core's operations for API front ends: client-written messages appended without generating, and
per-request options. A stateless client's history must give exactly the token ids and state records a
REPL turn gives, or the server's cache never hits (real model, greedy)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chatcli.core.conversation import Conversation
from chatcli.core.events import ConversationError, MessageTooLongError, ReplyEnd
from chatcli.core.kv import records as sf
from chatcli.session import Session
from tests.drive import drain, isolated_session, rebind, say

Q = "Name a fruit."


@pytest.fixture(scope="module")
def base_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    session = isolated_session(tmp_path_factory.mktemp("append") / "home")
    yield session
    session.close()


@pytest.fixture
def session(base_session: Session, chatcli_home: Path) -> Session:
    """The module's model load bound to this test's CHATCLI_HOME."""
    return rebind(base_session)


def test_append_user_then_regen_equals_a_sent_turn(session: Session) -> None:
    """append_user stores the message as send does before sampling: same tokens, the logits after it saved,
    so generating its reply evaluates nothing and gives the same reply with bit-identical logits."""
    sent, _, _ = drain(session.new_conversation("alice"))
    assert sent is not None
    want_reply, want_logits = say(sent, Q)
    want_tokens = sent.r.tokens()
    sent.close()

    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    steps = list(conv.append_user(Q))
    assert steps and steps[-1].done == steps[-1].total == len(conv.r.active[-1].tokens)
    assert conv.pending_user and conv.title == sent.title
    n_eval = session.engine.n_evaluated_total
    _, _, ends = drain(conv.regen())
    assert session.engine.n_evaluated_total - n_eval == len(ends[-1].message.tokens)  # the reply only
    assert ends[-1].message.tokens == want_reply and conv.r.tokens() == want_tokens
    assert conv.turn_logits is not None and np.array_equal(conv.turn_logits[1], want_logits)
    conv.close()


def test_a_client_written_history_resumes_and_continues_like_a_repl_one(session: Session) -> None:
    """Client-written messages give the REPL's token ids; the state records cover them exactly, so a resume
    restores them (nothing re-evaluated) and continues bit-identically to the process that appended them."""
    ref, _, _ = drain(session.new_conversation("alice"))
    assert ref is not None
    say(ref, Q)
    reply_text = ref.r.active[-1].text
    say(ref, "Another one?")
    ref_tokens = ref.r.tokens()
    ref.close()

    def appended() -> Conversation:
        conv, _, _ = drain(session.new_conversation("alice"))
        assert conv is not None
        with pytest.raises(ConversationError):
            list(conv.append_reply("a reply to nothing"))  # refused: the last message is not a user message
        list(conv.append_user(Q))
        list(conv.append_reply(reply_text))
        last = conv.r.active[-1]
        assert last.role == "assistant" and last.stop == "client" and last.text == reply_text
        assert conv.r.tokens() == ref_tokens[:last.p1]  # the template's rendering, closing included
        # Transcript first, then the state records: the state file covers exactly the transcript.
        assert sf.scan(conv.dir.state_path).live()[2] == last.p1 == session.engine.n_past
        conv.update_meta({"source": "api"})
        assert conv.dir.read_meta()["source"] == "api" and conv.dir.read_meta()["tokens"] == last.p1
        return conv

    stored = appended()
    stored.close()
    live = appended()  # continued in the process that appended it
    live_reply, live_logits = say(live, "Another one?")
    assert live.r.active[-2].tokens == ref_tokens[live.r.active[-2].p0:live.r.active[-2].p1]
    live.close()
    again, report, _ = drain(session.open_conversation(stored.id))
    assert again is not None and report is not None and report.reevaluated == 0
    got, logits = say(again, "Another one?")
    assert got == live_reply and np.array_equal(logits, live_logits)
    again.close()


def test_closing_an_append_mid_message_takes_it_back_out(session: Session) -> None:
    """A client that goes away between two batches of a long message: the message leaves the context
    (kept in the transcript, out of the active path, like a failed send); the conversation goes on."""
    eng = session.engine
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    say(conv, Q)
    before = conv.r.tokens()
    long_text = "The river runs past the old mill and the orchard. " * 90
    steps = conv.append_user(long_text)
    first = next(steps)
    assert first.stoppable and first.done == eng.n_batch < first.total  # one batch in, more to come
    steps.close()
    assert eng.tokens == before == conv.r.tokens() and not conv.pending_user
    assert any(e.get("type") == "truncate" and e.get("reason") == "failed"
               for e in conv.dir.read_transcript().events)
    # Too long for what is left of the context: refused before anything is written.
    n_events = len(conv.dir.read_transcript().events)
    with pytest.raises(MessageTooLongError):
        list(conv.append_user("word " * (eng.n_ctx - eng.n_past)))
    assert len(conv.dir.read_transcript().events) == n_events and eng.tokens == before
    _, _, ends = drain(conv.send("Another one?"))
    assert isinstance(ends[-1], ReplyEnd)
    cid = conv.id
    conv.close()
    again, report, _ = drain(session.open_conversation(cid))
    assert again is not None and report is not None and report.reevaluated == 0
    assert again.r.tokens() == eng.tokens
    again.close()


def test_per_request_options(session: Session) -> None:
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    template_stops = conv.stop_strings
    conv.set_options(max_tokens=5, extra_stop=["STOP"])
    assert conv.stop_strings == [*template_stops, "STOP"] and conv.max_tokens == 5
    _, _, ends = drain(conv.send(Q))
    assert ends[-1].stats.n_generated <= 5
    conv.set_options()  # the extra stop strings last until set again
    assert conv.stop_strings == template_stops and conv.max_tokens == 5
    conv.close()


def _user_cells_saved(path: Path, user: Any) -> bool:
    recs = sf.scan(path).records
    return (any(r.kind == sf.CELLS and (r.p0, r.p1) == (user.p0, user.p1) for r in recs)
            and any(r.kind == sf.LOGITS and r.p0 == user.p1 for r in recs))


def test_a_turn_saves_the_user_cells_with_the_reply(session: Session) -> None:
    """The user message's cells and logits are written with the reply's, in one append after its last token:
    nothing is written before the first token (the time to first token) or between two tokens (the stream)."""
    from chatcli.core.events import ReplyText

    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    path = conv.dir.state_path
    before = path.stat().st_size
    texts = 0
    for ev in conv.send(Q):
        if isinstance(ev, ReplyEnd):
            break
        assert path.stat().st_size == before, ev  # not one byte until the reply is over
        texts += isinstance(ev, ReplyText)
    assert texts > 2
    user = conv.r.active[-2]
    assert user.role == "user" and _user_cells_saved(path, user)
    conv.close()


def test_a_long_reply_saves_the_user_cells_while_it_streams(session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply still streaming LATE_SAVE_SECONDS after its first token writes the user message's cells then,
    so that a process killed during a long reply still finds them (here: at once, from the second token)."""
    from chatcli.core import conversation as conversation_mod
    from chatcli.core.events import ReplyText

    monkeypatch.setattr(conversation_mod, "LATE_SAVE_SECONDS", 0.0)
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    path = conv.dir.state_path
    before = path.stat().st_size
    gen = conv.send(Q)
    texts = 0
    for ev in gen:
        if isinstance(ev, ReplyText):
            texts += 1
            if texts == 1:
                assert path.stat().st_size == before  # the first token is out before the write
            elif texts == 3:
                break  # the generator ran past the second token: the write happened there
    gen.close()
    assert texts == 3
    user = conv.r.active[-2] if conv.r.active[-1].role == "assistant" else conv.r.active[-1]
    assert user.role == "user" and _user_cells_saved(path, user)
    conv.close()
