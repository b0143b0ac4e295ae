"""Issue #24's core items on the real model (SmolLM2, greedy): a reply that fills the context, messages left
out for invalid token ids, stop strings rolled back out of the context, client replies rebuilt as they were
evaluated, forks after a context shift, damaged message events, and an edited first message's title."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chatcli.core.conversation import Conversation
from chatcli.core.events import Notice, ReplyEnd, ResumeReport
from chatcli.core.transcript import replay_events
from tests.drive import isolated_session, rebind

N_CTX = 256
STORY = "Write a very long story about a dragon, at least 2000 words."


@pytest.fixture(scope="module")
def base_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    session = isolated_session(tmp_path_factory.mktemp("round3") / "home", threads=2, n_ctx=N_CTX, reserve=32,
                               max_tokens=1024)
    yield session
    session.close()


@pytest.fixture
def sess(base_session: Any, chatcli_home: Path) -> Any:
    """The module's session (its engine) bound to this test's CHATCLI_HOME."""
    return rebind(base_session)


def new_conv(session: Any, *msgs: str, max_tokens: int = 12) -> Conversation:
    conv = session.new_conversation("alice").conversation
    assert isinstance(conv, Conversation)
    conv.set_options(max_tokens=max_tokens)
    for m in msgs:
        send(conv, m)
    return conv


def send(conv: Conversation, text: str) -> tuple[ReplyEnd, list[Any]]:
    events = list(conv.send(text))
    ends = [ev for ev in events if isinstance(ev, ReplyEnd)]
    assert ends, events
    return ends[-1], events


def open_conv(session: Any, cid: str, max_tokens: int = 12) -> tuple[Conversation, ResumeReport, list[Any]]:
    opening = session.open_conversation(cid)
    events = list(opening)
    conv, report = opening.conversation, opening.report
    assert isinstance(conv, Conversation) and isinstance(report, ResumeReport)
    conv.set_options(max_tokens=max_tokens)
    return conv, report, events


def kv_bytes(conv: Conversation) -> bytes:
    return bytes(conv.backend.save_cells(0, conv.backend.n_past))  # type: ignore[attr-defined]


def closing_text(conv: Conversation) -> str:
    return conv.template.closing(conv.history())


# -- 1: a reply that fills the context -------------------------------------------------------------------


def test_a_reply_that_fills_the_context_keeps_its_closing_and_the_conversation_goes_on(sess: Any) -> None:
    conv = new_conv(sess, max_tokens=1024)
    end, _ = send(conv, STORY)
    eng = conv.backend
    assert end.stats.stop_reason == "context"
    assert eng.n_past <= eng.n_ctx
    # The reply holds its whole rendering, closing included (what a rebuild and a shift rely on).
    assert eng.detokenize(end.message.tokens).endswith(closing_text(conv))
    assert list(eng.tokens) == conv.r.tokens()
    cid = conv.id
    conv.close()

    conv, report, _ = open_conv(sess, cid, max_tokens=1024)
    assert report.reevaluated == 0
    regen = [ev for ev in conv.regen() if isinstance(ev, ReplyEnd)]
    assert regen and regen[-1].stats.stop_reason == "context"
    assert conv.backend.n_past <= conv.backend.n_ctx
    conv.set_options(max_tokens=12)
    end, events = send(conv, "Thanks! Now tell me a joke.")
    assert any(isinstance(ev, Notice) and "context full" in ev.text for ev in events)  # the next message shifts
    assert conv.undo().dropped
    conv.close()


def test_a_conversation_that_fills_the_context_exactly_opens_regenerates_and_shifts(
        sess: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As an older chatcli left it: the reply took every cell, no room for its closing."""
    with monkeypatch.context() as mp:
        mp.setattr(Conversation, "_closing_room", lambda self: 0, raising=False)
        conv = new_conv(sess, max_tokens=1024)
        send(conv, STORY)
        assert conv.backend.n_past == conv.backend.n_ctx
        cid = conv.id
        conv.close()
    conv, _, _ = open_conv(sess, cid)
    assert conv.backend.n_past == N_CTX
    _, events = send(conv, "Thanks! Now tell me a joke.")
    assert any(isinstance(ev, Notice) and "context full" in ev.text for ev in events)
    conv.close()
    conv, _, _ = open_conv(sess, cid)
    assert any(isinstance(ev, ReplyEnd) for ev in conv.regen())
    conv.close()


def test_serve_continues_a_conversation_whose_reply_filled_the_context_after_it_left_its_slot(
        sess: Any, tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    from chatcli.core.template import Message
    from chatcli.server.service import ChatRequest, ChatService, Finished

    def ask(svc: ChatService, msgs: list[Message], max_tokens: int) -> Finished:
        req = ChatRequest(list(msgs), temperature=0.0, max_tokens=max_tokens, seed=1)
        return [ev for ev in svc.complete(req) if isinstance(ev, Finished)][-1]

    sess.engine.clear()
    svc = ChatService(sess, parallel=1, index_path=tmp_path / "index.json")
    try:
        msgs = [Message("system", "You tell stories."), Message("user", STORY)]
        full = ask(svc, msgs, 100_000)  # a client's max_tokens far beyond the context: bounded by the room
        assert full.finish_reason == "length"
        ask(svc, [Message("system", "You are terse."), Message("user", "Hi!")], 8)  # takes the one slot
        nxt = ask(svc, [*msgs, Message("assistant", full.text), Message("user", "Thanks! Now a joke.")], 8)
        assert nxt.conversation == full.conversation
    finally:
        svc.close()


# -- 2: messages left out for invalid token ids ----------------------------------------------------------


def test_messages_left_out_for_invalid_tokens_are_truncated_and_later_turns_survive(sess: Any) -> None:
    conv = new_conv(sess, "Hi!", "Name a colour.")
    cid, path = conv.id, conv.dir.transcript_path
    conv.close()
    lines = path.read_text().splitlines()
    users = [i for i, line in enumerate(lines) if json.loads(line).get("role") == "user"]
    damaged = json.loads(lines[users[1]])
    damaged["tokens"][0] = 10**8  # not a token of any vocabulary
    lines[users[1]] = json.dumps(damaged)
    path.write_text("\n".join(lines) + "\n")

    conv, _, events = open_conv(sess, cid)
    assert any(isinstance(ev, Notice) and "invalid token ids" in ev.text for ev in events)
    assert [m.text for m in conv.messages if m.role == "user"] == ["Hi!"]
    send(conv, "Name a fruit.")
    expected = [(m.role, m.text, m.tokens) for m in conv.messages]
    conv.close()

    conv, report, events = open_conv(sess, cid)
    assert not any(isinstance(ev, Notice) and "invalid" in ev.text for ev in events)
    assert [(m.role, m.text, m.tokens) for m in conv.messages] == expected
    assert report.reevaluated == 0
    conv.close()
    # show / export read the transcript alone: they see the same messages.
    r = replay_events(conv.dir.read_transcript().events)
    assert [(m.role, m.text, m.tokens) for m in r.active] == expected


# -- 3: stop strings are rolled back out of the context --------------------------------------------------


def _cut_point(text: str) -> str:
    """A stop string that starts inside a word (so inside a token) after some text."""
    words = [w for w in text.split() if len(w) >= 5 and w.isalpha()]
    assert len(words) >= 2, text
    w = words[1]
    return w[2:4]


def test_a_stop_string_is_not_left_in_the_context_and_rebuilds_exactly(sess: Any) -> None:
    conv = new_conv(sess, max_tokens=40)
    free, _ = send(conv, "Describe the sea in two sentences.")
    stop = _cut_point(free.message.text)
    conv.set_options(extra_stop=[stop])
    end = [ev for ev in conv.regen() if isinstance(ev, ReplyEnd)][-1]
    text = end.message.text
    assert stop not in text and free.message.text.startswith(text)
    assert end.stats.stop_reason == "stop"
    eng = conv.backend
    # The context holds exactly what was returned, then the template's closing: nothing of the stop string.
    assert eng.detokenize(end.message.tokens, special=True) == text + closing_text(conv)
    assert list(eng.tokens) == conv.r.tokens()
    conv.set_options(extra_stop=[])
    send(conv, "And the sky?")
    live = kv_bytes(conv)
    cid, state = conv.id, conv.dir.state_path
    conv.close()
    state.unlink()
    conv, report, _ = open_conv(sess, cid)
    assert report.reevaluated == len(conv.r.tokens())
    assert kv_bytes(conv) == live  # the rebuild replays the batching: bit-identical
    conv.close()


# -- 4: client-written replies rebuild as one batch -------------------------------------------------------


def test_client_written_replies_rebuild_bit_identically(sess: Any) -> None:
    conv = new_conv(sess)
    for _ in conv.append_user("Tell me about whales."):
        pass
    pasted = ("Whales are large marine mammals. They breathe air through blowholes, live in every ocean, and "
              "some of them sing songs that travel for hundreds of kilometres under water.")
    for _ in conv.append_reply(pasted):
        pass
    assert conv.messages[-1].stop == "client"
    send(conv, "Which one is the biggest?")
    live = kv_bytes(conv)
    cid, state = conv.id, conv.dir.state_path
    conv.close()
    state.unlink()
    conv, report, _ = open_conv(sess, cid)
    assert report.reevaluated == len(conv.r.tokens())
    assert kv_bytes(conv) == live
    conv.close()


# -- 13: a damaged message event is skipped whole ---------------------------------------------------------


@pytest.mark.parametrize("damage", [{"role": None}, {"tokens": "oops"}, {"drop": "role"}, {"tokens": [1, "x"]}])
def test_a_damaged_message_event_does_not_break_regen_or_alternatives(sess: Any, damage: dict[str, Any]) -> None:
    conv = new_conv(sess, "Hi!")
    cid, path = conv.id, conv.dir.transcript_path
    reply = conv.messages[-1]
    conv.close()
    ev: dict[str, Any] = {"v": 1, "ts": 0, "type": "message", "mid": 50, "role": "assistant", "text": "x",
                          "tokens": [1], "span": [reply.p0, reply.p0 + 1], "turn": reply.turn, "alt": 1}
    if "drop" in damage:
        del ev[damage["drop"]]
    else:
        ev.update(damage)
    with path.open("a") as fh:
        fh.write(json.dumps(ev) + "\n")
    conv, _, _ = open_conv(sess, cid)
    assert len(conv.alternatives()) == 1
    assert any(isinstance(ev, ReplyEnd) for ev in conv.regen())
    assert len(conv.alternatives()) == 2
    conv.switch_alt(0)
    assert any("malformed" in p for p in conv.r.problems)
    new_mid = conv.r.next_mid
    assert new_mid > 50  # a damaged event's id is never reused
    conv.close()


# -- 9: forks after a context shift ------------------------------------------------------------------------


def _shifted_service(sess: Any, tmp_path: Path) -> tuple[Any, list[Any], str]:
    pytest.importorskip("starlette")
    from chatcli.core.template import Message
    from chatcli.server.service import ChatRequest, ChatService, Finished

    svc = ChatService(sess, parallel=1, index_path=tmp_path / "index.json")
    msgs = [Message("system", "You are terse.")]
    for i in range(8):
        msgs.append(Message("user", f"Question {i}: " + "tell me about the sea and the sky. " * 5))
        fin = [ev for ev in svc.complete(ChatRequest(list(msgs), temperature=0.0, max_tokens=12, seed=1))
               if isinstance(ev, Finished)][-1]
        msgs.append(Message("assistant", fin.text))
        if replay_events(svc.store.resolve(fin.conversation).read_transcript().events).out_of_context:
            return svc, msgs, fin.conversation
    raise AssertionError("the context never shifted")


@pytest.mark.parametrize("how", ["regenerate", "edit"])
def test_regenerate_or_edit_after_a_context_shift_forks_with_the_shifted_out_messages(
        sess: Any, tmp_path: Path, how: str) -> None:
    from chatcli.core.template import Message
    from chatcli.server.service import ChatRequest, Finished, Started

    sess.engine.clear()
    svc, msgs, cid = _shifted_service(sess, tmp_path)
    try:
        parent = replay_events(svc.store.resolve(cid).read_transcript().events)
        history = msgs[:-1] if how == "regenerate" else [*msgs[:-2], Message("user", "Something else entirely.")]
        events = list(svc.complete(ChatRequest(history, temperature=0.0, max_tokens=12, seed=1)))
        started = next(ev for ev in events if isinstance(ev, Started))
        fin = next(ev for ev in events if isinstance(ev, Finished))
        assert started.forked_from == cid and fin.conversation != cid
        child = replay_events(svc.store.resolve(fin.conversation).read_transcript().events)
        # The child carries the messages the shift took out, as out of context, like its parent.
        assert [child.all[m]["text"] for m in child.out_of_context] == \
            [parent.all[m]["text"] for m in parent.out_of_context]
        n_keep = len(parent.active) - (1 if how == "regenerate" else 2)
        assert [m.tokens for m in child.active[:n_keep]] == [m.tokens for m in parent.active[:n_keep]]
    finally:
        svc.close()


# -- 20: an edited first message retitles the conversation ------------------------------------------------


def test_editing_the_first_message_changes_an_automatic_title_not_a_chosen_one(sess: Any) -> None:
    conv = new_conv(sess, "Hi!", "Name a colour.")
    assert conv.title == "Hi!"
    list(conv.edit(1, "Hello there, who are you?"))
    assert conv.title == "Hello there, who are you?"
    assert conv.dir.read_meta()["title"] == "Hello there, who are you?"
    conv.set_title("My chat")
    list(conv.edit(1, "Good morning."))
    assert conv.title == "My chat"
    conv.close()


# -- 17: the state budget never touches a newer chatcli's files -------------------------------------------


def test_budget_eviction_never_touches_a_newer_chatclis_files(tmp_path: Path) -> None:
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.kv import budget
    from chatcli.core.kv import records as sf

    store = ConversationStore(tmp_path / "conversations")
    prefixes = tmp_path / "prefix"
    prefixes.mkdir()

    def state(fmt: int) -> bytes:
        header = json.dumps({"format": fmt, "identity": {"model": "m"}}).encode()
        return sf.encode_record(sf.HEADER, 0, 0, header) + b"\0" * 4096

    plain, newer_meta, newer_state = (store.create({"title": t}) for t in ("plain", "newer meta", "newer state"))
    for conv in (plain, newer_meta):
        conv.state_path.write_bytes(state(sf.PLAIN_FORMAT))
    newer_state.state_path.write_bytes(state(sf.FORMAT_VERSION + 1))
    meta = json.loads(newer_meta.meta_path.read_text())
    newer_meta.meta_path.write_text(json.dumps({**meta, "format": meta["format"] + 1}))
    (prefixes / "old.kv").write_bytes(state(sf.PLAIN_FORMAT))
    (prefixes / "new.kv").write_bytes(state(sf.FORMAT_VERSION + 1))
    kept = {p: p.read_bytes() for p in (newer_meta.state_path, newer_meta.meta_path, newer_state.state_path,
                                        newer_state.meta_path, prefixes / "new.kv")}

    freed = budget.enforce(store.root, prefixes, 0)
    assert {i.conv_id for i in freed.evicted} == {plain.id, None}
    assert not plain.state_path.exists() and not (prefixes / "old.kv").exists()
    assert {p: p.read_bytes() for p in kept} == kept
    assert not freed.spared_open  # a newer file is not an open conversation


# -- 19 and 20: piped `talk` says when a message failed; `resume` fits the reserve to a small saved n_ctx ---


def _chatcli(args: list[str], stdin: str) -> Any:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "CHATCLI_THREADS": "2"}
    return subprocess.run([sys.executable, "-m", "chatcli", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=600)


def test_piped_talk_exits_non_zero_when_a_message_is_refused() -> None:
    ok = _chatcli(["talk", "--temperature", "0", "--max-tokens", "4"], "Hi!\n")
    assert ok.returncode == 0, ok.stderr
    bad = _chatcli(["talk", "--temperature", "0", "--max-tokens", "4", "--n-ctx", "256", "--reserve", "32"],
                   "word " * 400 + "\n")
    assert "message too long" in bad.stderr
    assert bad.returncode == 1


def test_a_full_small_context_resumes_regenerates_and_continues_from_the_cli() -> None:
    first = _chatcli(["talk", "--temperature", "0", "--n-ctx", "256", "--reserve", "32", "--max-tokens", "1024"],
                     STORY + "\n")
    assert first.returncode == 0, first.stderr
    assert "context full" in first.stderr
    # Resumed with the default reserve (256, more than the saved context of 256): it is fitted to the context.
    nxt = _chatcli(["resume"], "Thanks! Now a joke.\n")
    assert nxt.returncode == 0, nxt.stderr
    assert "left the context" in nxt.stderr and "error" not in nxt.stderr
    regen = _chatcli(["regen"], "")
    assert regen.returncode == 0, regen.stderr
    explicit = _chatcli(["resume", "--reserve", "300"], "More.\n")
    assert explicit.returncode != 0 and "reserve" in explicit.stderr


def test_temp_files_left_in_the_prefix_cache_by_a_killed_writer_are_removed(sess: Any) -> None:
    import os
    import time

    cache = sess.paths.prefix_cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    stale, fresh = cache / ".abc.kv.x1.tmp", cache / ".abc.kv.x2.tmp"
    for p in (stale, fresh):
        p.write_bytes(b"\0" * 1000)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    new_conv(sess).close()  # a cache miss: the prefix file is written
    assert list(cache.glob("*.kv"))
    assert not stale.exists()
    assert fresh.exists()  # maybe another process's write in progress
