"""core/transcript.py on the real model: a damaged transcript keeps what is intact and says what was
dropped; a transcript write that fails changes nothing; alternatives belong to their own user message
(docs/PROMISES.md 5, 7)."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from chatcli.core.backend import BackendError
from chatcli.core.events import ConversationError
from chatcli.core.files.store import ConversationDir, StoreError
from tests.golden import MSGS, DiskFull, conv_path, install, open_conv, reply, state_tokens

# The shared fixtures (sess, golden: tests/golden.py, a plugin of tests/conftest.py), on one llama.cpp thread.
pytestmark = pytest.mark.usefixtures("one_thread")


def _transcript_lines(cid: str) -> list[bytes]:
    return (conv_path(cid) / "transcript.jsonl").read_bytes().split(b"\n")[:-1]


def _write_lines(cid: str, lines: list[bytes], final_newline: bool = True) -> None:
    (conv_path(cid) / "transcript.jsonl").write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))


def test_torn_last_transcript_line_is_dropped_reported_and_repaired(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    lines = _transcript_lines(cid)  # prefix, user, assistant, user, assistant
    lines[-1] = lines[-1][: len(lines[-1]) // 2]
    _write_lines(cid, lines, final_newline=False)
    conv, report, notices = open_conv(sess, cid)
    try:
        assert any("torn" in n for n in notices), notices
        kept = golden["main"]["messages"][:3]
        assert [(m.role, m.text, m.tokens) for m in conv.messages] == kept
        assert sess.engine.tokens == conv.r.tokens()
        assert report.reevaluated == 0  # the cells of the kept messages came from the state file
        assert state_tokens(conv.dir.state_path) == conv.r.tokens()
        # The torn bytes are gone, so later opens do not warn again and later appends start a new line.
        assert ConversationDir(conv.dir.path).read_transcript().problems == []
        assert conv.dir.transcript_path.read_bytes().endswith(b"\n")
        # The lost reply is regenerated from the saved logits: the same reply, bit for bit.
        end = reply(conv.regen())
        assert (end.message.role, end.message.text, end.message.tokens) == golden["main"]["messages"][3]
    finally:
        conv.close()


def test_garbage_line_in_the_middle_is_skipped_and_named(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    lines = _transcript_lines(cid)
    _write_lines(cid, [*lines[:3], b"\x00\x13garbage{{{\xff", *lines[3:]])
    conv, report, notices = open_conv(sess, cid)
    try:
        assert any("line 4" in n for n in notices), notices
        assert [(m.role, m.text, m.tokens) for m in conv.messages] == golden["main"]["messages"]
        assert report.reevaluated == 0 and sess.engine.tokens == golden["main"]["tokens"]
    finally:
        conv.close()


def test_destroyed_message_drops_what_depends_on_it_and_says_so(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    lines = _transcript_lines(cid)
    lines[3] = b'{"v": 1, "type": "message", "mid": '  # the second user message, half overwritten
    _write_lines(cid, lines)
    conv, report, notices = open_conv(sess, cid)
    try:
        assert any("line 4" in n for n in notices), notices
        assert any("skipped" in n and "message 3" in n for n in notices), notices  # its reply cannot be placed
        assert [(m.role, m.text, m.tokens) for m in conv.messages] == golden["main"]["messages"][:2]
        assert sess.engine.tokens == conv.r.tokens()
        assert report.restored_tokens <= len(conv.r.tokens())
        assert state_tokens(conv.dir.state_path) == conv.r.tokens()
        assert reply(conv.send(MSGS[1])).message.tokens
    finally:
        conv.close()


@pytest.mark.parametrize("content", ["random-bytes", "zero-filled", "text"])
def test_unreadable_transcript_is_reported_and_loads_no_cells(content: str, sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    tr = conv_path(cid) / "transcript.jsonl"
    size = tr.stat().st_size
    tr.write_bytes({"random-bytes": random.Random(3).randbytes(size), "zero-filled": bytes(size),
                    "text": b"Dear diary,\ntoday I wrote a transcript by hand.\n"}[content])
    conv, report, notices = open_conv(sess, cid)
    try:
        assert any("unreadable" in n for n in notices), notices
        # Nothing readable is left but the persona: the conversation restarts from it (its cells still match
        # the state file's first record, so they load), and no message of the lost text is invented.
        assert conv.messages == []
        assert sess.engine.tokens == conv.r.tokens() == conv.r.prefix_tokens != []
        assert report.restored_tokens == len(conv.r.prefix_tokens)
    finally:
        conv.close()


def test_transcript_without_its_prefix_keeps_the_persona_or_refuses(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    (conv_path(cid) / "transcript.jsonl").write_bytes(b"")
    try:
        conv, _, _ = open_conv(sess, cid)
    except (ConversationError, StoreError):
        return  # refusing with a one-line error is acceptable
    try:
        assert conv.r.prefix_tokens == golden["main"]["tokens"][: len(conv.r.prefix_tokens)] != []
    finally:
        conv.close()


def test_out_of_vocabulary_token_in_transcript_skips_that_message(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    lines = _transcript_lines(cid)
    ev = json.loads(lines[3])
    ev["tokens"][1] = sess.engine.n_vocab + 40000
    lines[3] = json.dumps(ev).encode()
    _write_lines(cid, lines)
    (conv_path(cid) / "state.kv").unlink()  # as after any rebuild: the tokens are evaluated
    conv, _, notices = open_conv(sess, cid)
    try:
        assert any("message 2" in n or "line 4" in n for n in notices), notices
        assert sess.engine.tokens == conv.r.tokens()
    finally:
        conv.close()


def test_random_bit_flips_in_transcript_never_crash_or_desync(sess: Any, golden: dict[str, Any]) -> None:
    """A flip that breaks a line is reported; one that leaves valid JSON (lines carry no checksum) changes
    what the transcript says -- but the context always holds exactly the transcript's tokens."""
    rng = random.Random(11)
    original = (golden["main"]["path"] / "transcript.jsonl").read_bytes()
    reported = 0
    # The first flip always breaks a line (the "{" opening the first message); the others land anywhere.
    flips = [(original.index(b"\n") + 1, 0x10)] + [(rng.randrange(len(original)), 1 << rng.randrange(8)) for _ in range(7)]
    for i, (pos, bit) in enumerate(flips):
        cid = install(golden)
        data = bytearray(original)
        data[pos] ^= bit
        (conv_path(cid) / "transcript.jsonl").write_bytes(bytes(data))
        try:
            conv, _, notices = open_conv(sess, cid)
        except (ConversationError, StoreError, BackendError) as exc:
            # a one-line user error (the CLI exits 1 or 2), never a traceback
            assert str(exc) and "\n" not in str(exc)
            reported += 1
        else:
            reported += bool(notices)
            assert sess.engine.tokens == conv.r.tokens(), (i, pos)
            assert state_tokens(conv.dir.state_path) == conv.r.tokens(), (i, pos)
            conv.close()
        shutil.rmtree(conv_path(cid))
    assert reported  # at least the first flip was named


def test_disk_full_while_writing_the_transcript_changes_nothing(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    conv, _, _ = open_conv(sess, cid)
    try:
        before = conv.dir.transcript_path.read_bytes()
        tokens = list(sess.engine.tokens)
        with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError) as info:
            mp.setattr(os, "write", DiskFull("transcript.jsonl"))
            reply(conv.send(MSGS[2]))
        assert info.value.errno == errno.ENOSPC  # the REPL shows it as one line and keeps the text
        assert conv.dir.transcript_path.read_bytes() == before  # no half line for the next append to spoil
        assert sess.engine.tokens == tokens and not conv.pending_user
        end = reply(conv.send(MSGS[2]))
        assert end.message.tokens == golden["next_reply"]
    finally:
        conv.close()


def test_disk_full_while_writing_a_reply_then_regen(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    conv, _, _ = open_conv(sess, cid)
    try:
        import chatcli.core.files.store as store_mod

        real = store_mod.append_durably

        def fail_on_reply(path: Path, data: bytes) -> None:
            if b'"role":"assistant"' in data:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(path, data)

        with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError):
            mp.setattr(store_mod, "append_durably", fail_on_reply)
            reply(conv.send(MSGS[2]))
        assert sess.engine.tokens == conv.r.tokens()
        reply(conv.regen())
    finally:
        conv.close()
    conv, _, notices = open_conv(sess, cid)
    conv.close()
    assert not any("skipped" in n for n in notices), notices
    assert conv.messages[-1].role == "assistant"


def test_alternatives_belong_to_their_own_user_message(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    conv, _, _ = open_conv(sess, cid)
    try:
        conv.undo(1)
        end = reply(conv.send("Name a colour."))
        alts = conv.r.alternatives(end.message.turn)
        assert [e["mid"] for e in alts] == [end.message.mid]
    finally:
        conv.close()
