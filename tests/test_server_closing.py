"""A served reply's end (its last sampled token and the ``<|im_end|>\\n`` after it) is evaluated with the next
prompt, as llama-server evaluates it: no decode after the last token is sampled, two decodes less per turn, and
what is saved is what was computed.

- after a reply the state file holds the reply without its last token and closing, and nothing is decoded
  after the end; each way a reply ends (end of generation, max_tokens, a stop string, a client gone) leaves
  the right tokens due;
- the next message of that conversation is evaluated with them in one call, and the transcript says so;
- a conversation whose state is gone is rebuilt with the same calls (the rebuild replays the folded one);
- a copy rebuilt from what was saved continues exactly as the live one (tokens, bit-identical logits);
- the operations that are not a new prompt (a regenerate, an undo, an edit, a shutdown) decode them first;
- a conversation left with its end due resumes (those tokens evaluated, nothing lost), and its state file is
  appended to, not rewritten.

Real model (the bundled SmolLM2), greedy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import llama_cpp
import pytest

from chatcli.core.events import ReplyText
from chatcli.core.steps import drain
from chatcli.core.template import Message
from chatcli.core.transcript import replay_events
from chatcli.server.service import ChatRequest, ChatService, Finished
from tests.golden import state_tokens

BASE_SESSION = {"max_tokens": 16}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?"]


def _req(msgs: list[dict[str, str]]) -> ChatRequest:
    return ChatRequest(messages=[Message(m["role"], m["content"]) for m in msgs], temperature=0.0, seed=7,
                       max_tokens=16)


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every ``llama_decode`` from now on."""
    sizes: list[int] = []
    real = llama_cpp.llama_decode

    def spy(ctx: Any, batch: Any) -> int:
        sizes.append(int(batch.n_tokens))
        return int(real(ctx, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", spy)
    return sizes


def _turn(svc: ChatService, msgs: list[dict[str, str]], decodes: list[int]) -> tuple[Finished, list[int], list[int]]:
    """One request: its Finished, the decodes up to it, and the decodes after it (the state write)."""
    decodes.clear()
    it: Iterator[Any] = svc.complete(_req(msgs))
    fin = next(e for e in it if isinstance(e, Finished))
    before = list(decodes)
    decodes.clear()
    for _ in it:
        pass
    return fin, before, list(decodes)


def _conversation(svc: ChatService, decodes: list[int], turns: int) -> tuple[list[dict[str, str]], list[Any]]:
    msgs: list[dict[str, str]] = [SYSTEM]
    out = []
    for t in TURNS[:turns]:
        msgs.append({"role": "user", "content": t})
        res = _turn(svc, msgs, decodes)
        out.append(res)
        msgs.append({"role": "assistant", "content": res[0].text})
    return msgs, out


def _singles(sizes: list[int]) -> int:
    """How many one-token decodes end ``sizes`` (a reply's sampled tokens, after its prompt)."""
    n = 0
    while n < len(sizes) and sizes[-1 - n] == 1:
        n += 1
    return n


def test_the_reply_s_end_is_evaluated_with_the_next_prompt(chat_service: ChatService, sess: Any,
                                                           decodes: list[int]) -> None:
    _msgs, [(fin1, during1, after1), (fin2, during2, after2)] = _conversation(chat_service, decodes, 2)
    assert fin1.conversation == fin2.conversation
    assert fin1.finish_reason == fin2.finish_reason == "length"  # max_tokens: the last one known before its decode
    # Every sampled token but the last was decoded (the first is sampled from the prompt's logits); nothing
    # after the end: the last token and the closing wait for the next prompt.
    assert _singles(during1) == _singles(during2) == fin1.completion_tokens - 1 == fin2.completion_tokens - 1
    assert after1 == after2 == []
    conv_dir = sess.store.dir(fin1.conversation)
    r = replay_events(conv_dir.read_transcript().events)
    reply1, user2, reply2 = r.active[-3:]
    closing = sess.engine.tokenize("<|im_end|>\n", add_special=False)
    n_due = user2.with_closing
    assert n_due == 1 + len(closing) and reply1.tokens[-len(closing):] == closing
    # The second request's first decode: the first reply's last token, its closing and the new message.
    assert during2[0] == n_due + len(user2.tokens)
    assert fin2.prompt_n == fin2.evaluated == during2[0]
    # Saved: everything but the last reply's last token and closing, which the context does not hold either.
    want = r.tokens()
    assert reply2.tokens[-n_due:] == want[-n_due:] and want[-len(closing):] == closing
    assert state_tokens(conv_dir.state_path) == want[:-n_due] == list(sess.engine.tokens)


def _after_prefix(sizes: list[int], n_prefix: int) -> list[int]:
    """The decodes after those that evaluated the persona prefix (a new conversation's, or a rebuild's)."""
    done = i = 0
    while i < len(sizes) and done < n_prefix:
        done += sizes[i]
        i += 1
    assert done in (0, n_prefix)
    return sizes[i:]


def test_a_rebuilt_conversation_replays_the_calls_the_server_made(chat_service: ChatService, sess: Any,
                                                                   decodes: list[int]) -> None:
    _msgs, turns = _conversation(chat_service, decodes, 3)
    fin = turns[0][0]
    eng = sess.engine
    n = eng.n_past
    live, toks = bytes(eng.save_cells(0, n)), list(eng.tokens)
    made = [d for _f, during, after in turns for d in [*during, *after]]
    decodes.clear()
    chat_service.close()  # decodes the last closing: the state file holds everything
    made += decodes
    conv_dir = sess.store.dir(fin.conversation)
    r = replay_events(conv_dir.read_transcript().events)
    assert state_tokens(conv_dir.state_path) == r.tokens()
    assert [m.with_closing > 0 for m in r.active if m.role == "user"] == [False, True, True]
    conv_dir.state_path.unlink()  # evicted: rebuilt from the transcript
    eng.clear()
    decodes.clear()
    done = drain(sess.open_conversation(fin.conversation))
    conv = done.conversation
    assert conv is not None
    try:
        assert done.report is not None and done.report.reevaluated == len(r.tokens())
        # The same calls, batch for batch: each folded closing with the message after it.
        n_prefix = len(r.prefix_tokens)
        assert _after_prefix(decodes, n_prefix) == _after_prefix(made, n_prefix)
        assert list(eng.tokens[:n]) == toks
        assert bytes(eng.save_cells(0, n)) == live
    finally:
        conv.close()


def test_a_fork_at_a_user_message_decodes_no_closing(chat_service: ChatService, sess: Any,
                                                      decodes: list[int]) -> None:
    msgs, [(fin, _, _)] = _conversation(chat_service, decodes, 1)
    # The same history again ending at the user message: a new reply to it, forked from the resident cells.
    res, during, _ = _turn(chat_service, msgs[:-1], decodes)
    assert res.forked_from == fin.conversation
    assert during == [1] * len(during)  # only the new reply's tokens: the parent's closing is not needed
    parent = sess.store.dir(fin.conversation)
    want = replay_events(parent.read_transcript().events).tokens()
    saved = state_tokens(parent.state_path)
    assert saved is not None and len(saved) < len(want) and saved == want[:len(saved)]


def test_a_regenerate_decodes_the_closing_first_and_keeps_the_reply_whole(sess: Any, decodes: list[int]) -> None:
    sess.engine.clear()
    conv = sess.new_conversation("alice").conversation
    try:
        # Sampled (a greedy regenerate gives the same reply, whose cells would do for the old one).
        conv.set_options(max_tokens=12, sampling=dataclasses.replace(conv.sampling, temperature=1.5))
        conv.defer_writes()  # as the server does
        drain(conv.send(TURNS[0]))
        conv.commit()
        n_due = len(conv._closing_due)
        assert n_due > 1 and conv._due_sampled == 1
        decodes.clear()
        drain(conv.regen())
        # The old reply's last token alone, then its closing (its rebuild plan), before the rollback.
        assert decodes[:2] == [1, n_due - 1]
        conv.commit()
        r = replay_events(conv.dir.read_transcript().events)
        old, new = r.alternatives(r.active[-1].turn)
        assert old["tokens"] != new["tokens"]
        assert state_tokens(conv.dir.state_path) == r.tokens()[:-len(conv._closing_due)]
        # The old reply's cells were saved whole before the rollback: /alt back to it evaluates nothing.
        decodes.clear()
        stats = conv.switch_alt(0)
        assert stats.n_eval == 0
    finally:
        conv.close()


def test_a_conversation_left_with_its_closing_due_resumes_by_appending(chat_service: ChatService, sess: Any,
                                                                        decodes: list[int]) -> None:
    msgs, [(fin, _, _)] = _conversation(chat_service, decodes, 1)
    conv_dir = sess.store.dir(fin.conversation)
    want = replay_events(conv_dir.read_transcript().events).tokens()
    saved = state_tokens(conv_dir.state_path)
    assert saved is not None and saved == want[:len(saved)] and len(saved) < len(want)
    size = conv_dir.state_path.stat().st_size
    head = conv_dir.state_path.read_bytes()
    # Another context takes over (as after an eviction or a server killed here): the resume evaluates the
    # closing and appends its cells; the records before it are left as they are.
    sess.engine.clear()
    chat_service._slots[0].conv = None
    decodes.clear()
    msgs.append({"role": "user", "content": TURNS[1]})
    res, during, _ = _turn(chat_service, msgs, decodes)
    assert res.conversation == fin.conversation and res.state == "disk"
    # The reply's last token alone, then its closing (as the transcript says): nothing lost.
    assert during[:2] == [1, len(want) - len(saved) - 1]
    assert conv_dir.state_path.read_bytes()[:size] == head
    r = replay_events(conv_dir.read_transcript().events)
    assert r.tokens()[:len(want)] == want and r.active[-2].with_closing == 0  # the message evaluated alone
    assert list(sess.engine.tokens) + chat_service._slots[0].conv._closing_due == r.tokens()


def _served(sess: Any, **opts: Any) -> Any:
    """A new conversation held as the server holds one (writes deferred: a reply's end is left due)."""
    sess.engine.clear()
    conv = sess.new_conversation("alice").conversation
    conv.set_options(**opts)
    conv.defer_writes()
    return conv


def _gone_after(events: Iterator[Any], n_text: int) -> None:
    """Read a reply's events, closing the operation after ``n_text`` text pieces (a client that went away)."""
    seen = 0
    for ev in events:
        if isinstance(ev, ReplyText):
            seen += 1
            if seen == n_text:
                break
    close = getattr(events, "close", None)
    assert close is not None
    close()


def _cancel_after(conv: Any, n_text: int) -> None:
    """Read a reply's events, asking the engine to stop after ``n_text`` text pieces (a shutdown), to the end."""
    seen = 0
    for ev in conv.send(TURNS[0]):
        if isinstance(ev, ReplyText):
            seen += 1
            if seen == n_text:
                conv.cancel()


@pytest.mark.parametrize("how", ["eog", "length", "stop", "stop inside a token", "client gone", "cancelled"])
def test_each_way_a_reply_ends_leaves_its_last_token_due(sess: Any, decodes: list[int], how: str) -> None:
    closing = sess.engine.tokenize("<|im_end|>\n", add_special=False)
    opts: dict[str, Any] = {"max_tokens": 5 if how == "length" else 48}
    # The greedy reply to TURNS[0] is "Hello, I'm Alice! My name is Emily." (end of generation).
    if how.startswith("stop"):
        opts["extra_stop"] = ["Alice" if how == "stop" else "ice"]
    conv = _served(sess, **opts)
    try:
        decodes.clear()
        if how == "client gone":
            _gone_after(conv.send(TURNS[0]), 3)
        elif how == "cancelled":
            _cancel_after(conv, 3)
        else:
            drain(conv.send(TURNS[0]))
        conv.commit()
        eng = sess.engine
        r = replay_events(conv.dir.read_transcript().events)
        reply = r.active[-1]
        due = conv._closing_due
        # The transcript has the whole reply; the context and the state file have all but what is due.
        assert [*eng.tokens, *due] == r.tokens()
        assert state_tokens(conv.dir.state_path) == list(eng.tokens)
        assert due[-len(closing):] == closing
        n_sampled = conv.last_stats.n_generated
        # The reply's sampled tokens were decoded but the last (the first is sampled from the prompt's logits).
        assert _singles(decodes) == n_sampled - 1
        if how == "eog":
            assert reply.stop == "eog" and due == closing and conv._due_sampled == 1  # <|im_end|> sampled
        elif how == "length":
            assert reply.stop == "length" and n_sampled == 5 and conv._due_sampled == 1 and len(due) == 1 + len(closing)
        elif how == "stop":
            # The token that completed the stop string is cut, never decoded: only the closing is due.
            assert reply.stop == "stop" and reply.text == "Hello, I'm" and conv._due_sampled == 0 and due == closing
        elif how == "stop inside a token":
            # The rest of the cut token (" Al") is the reply's last token: due, as a sampled last one.
            assert reply.stop == "stop" and reply.text == "Hello, I'm Al" and conv._due_sampled == 1
            assert due[:1] == eng.tokenize(" Al", add_special=False) and len(due) == 1 + len(closing)
        else:
            assert reply.stop == "cancelled" and conv._due_sampled == 1 and len(due) == 1 + len(closing)
        # The next message is evaluated with them, in one call.
        decodes.clear()
        drain(conv.send(TURNS[1]))
        user = conv.r.active[-2]
        assert user.with_closing == len(due) and decodes[0] == len(due) + len(user.tokens)
    finally:
        conv.close()


def test_a_copy_rebuilt_from_what_was_saved_continues_as_the_live_one(sess: Any, tmp_path: Any,
                                                                      decodes: list[int]) -> None:
    import shutil

    import numpy as np

    conv = _served(sess, max_tokens=16)
    eng = sess.engine
    try:
        for t in TURNS:  # each reply's end folded into the next message's call; the last one settled
            drain(conv.send(t))
            conv.commit()
        users = [m for m in conv.r.active if m.role == "user"]
        # Each reply ends with <|im_end|> sampled (not decoded) and the closing's \n: folded, two tokens.
        assert [m.with_closing for m in users] == [0, 2, 2]
        conv.close_reply()
        n = eng.n_past
        live_cells, live_logits = bytes(eng.save_cells(0, n)), eng.logits()
        saved = tmp_path / "saved"
        shutil.copytree(conv.dir.path, saved)
        drain(conv.send("Thanks."))
        live_reply = conv.r.active[-1].tokens
        live_turn = conv.log.turn_logits
        cid = conv.id
    finally:
        conv.close()
    # The copy: what was saved, its state file gone (evicted): rebuilt from the transcript, call for call.
    conv_dir = sess.store.dir(cid)
    shutil.rmtree(conv_dir.path)
    shutil.copytree(saved, conv_dir.path)
    conv_dir.state_path.unlink()
    eng.clear()
    done = drain(sess.open_conversation(cid))
    copy = done.conversation
    assert copy is not None
    try:
        assert done.report is not None and done.report.reevaluated == n
        assert bytes(eng.save_cells(0, n)) == live_cells
        assert np.array_equal(eng.logits(), live_logits)
        copy.defer_writes()
        drain(copy.send("Thanks."))
        assert copy.r.active[-1].tokens == live_reply
        turn = copy.log.turn_logits
        assert turn is not None and live_turn is not None and turn[0] == live_turn[0]
        assert np.array_equal(turn[1], live_turn[1])
    finally:
        copy.close()


def test_undo_redo_and_edit_after_a_reply_left_due(sess: Any, decodes: list[int]) -> None:
    conv = _served(sess, max_tokens=5)  # cut by max_tokens: its last token, then <|im_end|>\n, are due
    eng = sess.engine
    try:
        drain(conv.send(TURNS[0]))
        conv.commit()
        n_due = len(conv._closing_due)
        assert n_due == 3 and conv._due_sampled == 1
        decodes.clear()
        stats = conv.undo()
        assert decodes == [1, n_due - 1]  # the reply's end first (its rebuild plan), then the rollback
        assert conv._closing_due == [] and state_tokens(conv.dir.state_path) == conv.r.tokens() == list(eng.tokens)
        decodes.clear()
        stats = conv.redo()
        assert stats.n_eval == 0 and decodes == []  # the undone exchange's cells were saved whole
        assert list(eng.tokens) == conv.r.tokens()
        drain(conv.send(TURNS[1]))  # a reply of its own, left due again
        conv.commit()
        assert len(conv._closing_due) == n_due
        decodes.clear()
        drain(conv.edit(None, TURNS[2]))
        assert decodes[:2] == [1, n_due - 1]  # settled before the cut
        conv.commit()
        r = replay_events(conv.dir.read_transcript().events)
        assert r.active[-1].role == "assistant" and r.active[-2].text == TURNS[2]
        assert [*eng.tokens, *conv._closing_due] == r.tokens()
        assert state_tokens(conv.dir.state_path) == list(eng.tokens)
    finally:
        conv.close()
