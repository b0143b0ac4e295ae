"""core/kv/log.py on the real model: what the state log restores from a damaged state file, what it
writes when the disk is full (docs/PROMISES.md 2, 4, 7)."""

from __future__ import annotations

import errno
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chatcli.core.conversation import Conversation
from chatcli.core.events import Notice, ReplyEnd
from chatcli.core.files.store import ConversationDir
from chatcli.core.kv import records as sf
from tests.golden import MSGS, DiskFull, conv_path, install, open_conv, reply, state_tokens

# The shared fixtures (sess, golden: tests/golden.py, a plugin of tests/conftest.py), on one llama.cpp thread.
pytestmark = pytest.mark.usefixtures("one_thread")


def _flip(data: bytearray, offset: int, bit: int = 0x10) -> None:
    data[offset] ^= bit


def _damage_state(path: Path, how: str, golden: dict[str, Any]) -> int:
    """Damage the state file; returns the most tokens that may still be restored from it."""
    res = sf.scan(path)
    cells = [r for r in res.records if r.kind == sf.CELLS]
    data = bytearray(path.read_bytes())
    second = cells[1]  # the first user message's cells (the first CELLS record is the persona prefix)
    if how == "header-bitflip":
        _flip(data, sf.HEADER_SIZE + 5)
        bound = 0
    elif how == "middle-record-bitflip":
        _flip(data, second.offset + sf.HEADER_SIZE + second.length // 2)
        bound = second.p0
    elif how == "record-position-bitflip":
        _flip(data, second.offset + 12, 0x01)  # p0 field: the crc covers record headers too
        bound = second.p0
    elif how == "zeroed-4k-in-the-middle":
        mid = len(data) // 2
        data[mid:mid + 4096] = bytes(4096)
        bound = max(r.p1 for r in res.records if r.offset + r.size <= mid)
    elif how == "zero-filled":
        data = bytearray(len(data))
        bound = 0
    elif how == "truncated-to-3-bytes":
        data = data[:3]
        bound = 0
    elif how == "empty":
        data = bytearray()
        bound = 0
    elif how == "random-bytes":
        data = bytearray(random.Random(5).randbytes(len(data)))
        bound = 0
    elif how == "json-file":
        data = bytearray(b'{"this": "is not a state file"}\n')
        bound = 0
    elif how == "valid-crc-wrong-tokens":
        # A well-formed record (right positions, valid checksum) whose token ids are not the transcript's:
        # its cells belong to other text and must never be loaded.
        last = cells[-1]
        toks, kv = sf.split_cells(sf.read_payload(path, last), last.p1 - last.p0)
        toks[0] = (toks[0] + 1) % 1000
        del data[last.offset:last.offset + last.size]
        data[last.offset:last.offset] = sf.encode_record(sf.CELLS, last.p0, last.p1, sf.cells_payload(toks, kv))
        bound = last.p0
    elif how == "valid-crc-gap":
        # A well-formed record that does not continue the state (starts past its end): a writer bug.
        n = cells[-1].p1
        data += sf.encode_record(sf.CELLS, n + 3, n + 4, sf.cells_payload([1], b"x"))
        bound = n  # everything before it is fine
    else:
        raise AssertionError(how)
    path.write_bytes(bytes(data))
    return bound


DAMAGE = ["header-bitflip", "middle-record-bitflip", "record-position-bitflip", "zeroed-4k-in-the-middle",
          "zero-filled", "truncated-to-3-bytes", "empty", "random-bytes", "json-file", "valid-crc-wrong-tokens",
          "valid-crc-gap"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_state_file_is_detected_and_never_loads_wrong_cells(how: str, sess: Any, golden: dict[str, Any]) -> None:
    # (test_persistence covers damage to the *last* record and another model's state.)
    cid = install(golden)
    path = conv_path(cid) / "state.kv"
    bound = _damage_state(path, how, golden)
    conv, report, _ = open_conv(sess, cid)
    try:
        want = golden["main"]["tokens"]
        assert report.reason, "damage went unnoticed"
        assert report.restored_tokens <= bound, (report.restored_tokens, bound)
        assert sess.engine.tokens == want
        assert report.restored_tokens + report.reevaluated == len(want)
        assert state_tokens(path) == want  # repaired on disk: the next resume restores everything
        assert reply(conv.send(MSGS[2])).message.tokens  # and the conversation goes on,
        assert state_tokens(path) == sess.engine.tokens  # its new cells readable behind the repaired ones
    finally:
        conv.close()


def test_state_file_of_another_conversation_loads_only_cells_of_the_same_tokens(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    shutil.copy(golden["other"]["path"] / "state.kv", conv_path(cid) / "state.kv")
    want, other = golden["main"]["tokens"], golden["other"]["tokens"]
    common = next(i for i, (a, b) in enumerate(zip(want, other, strict=False)) if a != b)
    conv, report, _ = open_conv(sess, cid)
    try:
        assert "does not match" in report.reason
        assert 0 < report.restored_tokens <= common  # the shared persona prefix is the same cells, nothing more
        assert sess.engine.tokens == want
        assert state_tokens(conv.dir.state_path) == want
    finally:
        conv.close()


def test_intact_state_continues_bit_identically(sess: Any, golden: dict[str, Any]) -> None:
    """The baseline the damage tests are measured against: nothing damaged, nothing re-evaluated."""
    cid = install(golden)
    conv, report, notices = open_conv(sess, cid)
    try:
        assert report.reason == "" and report.reevaluated == 0 and not notices
        end = reply(conv.send(MSGS[2]))
        assert end.message.tokens == golden["next_reply"]
        assert conv.turn_logits is not None
        assert np.array_equal(conv.turn_logits[1], golden["next_logits"])
    finally:
        conv.close()


def test_disk_full_while_saving_state_tells_the_user_and_the_session_goes_on(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    conv, _, _ = open_conv(sess, cid)
    try:
        full = DiskFull("state.kv")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "write", full)
            end = reply(conv.send(MSGS[2]))
        assert full.failures > 0
        assert "could not save" in conv.save_error  # what the REPL shows as a warning
        # Consistent on disk: the transcript has the turn; the state file holds a clean prefix of it, with no
        # half-written record (the failed append was cut back) and no temp file.
        on_disk = ConversationDir(conv.dir.path).read_transcript()
        assert on_disk.problems == [] and on_disk.events[-1]["tokens"] == end.message.tokens
        saved = state_tokens(conv.dir.state_path)
        assert saved is not None and saved == conv.r.tokens()[: len(saved)]
        assert not list(conv.dir.path.glob(".*.tmp"))
        reply(conv.send("Thanks!"))  # room again
        assert conv.save_error == ""
        assert state_tokens(conv.dir.state_path) == sess.engine.tokens
        want = list(sess.engine.tokens)
    finally:
        conv.close()
    conv, report, _ = open_conv(sess, cid)
    conv.close()
    assert report.reevaluated == 0 and sess.engine.tokens == want


# -- a failed state write is a Notice when it happens ---------------------------------------------------------


def new_conv(session: Any, *msgs: str) -> Conversation:
    conv = session.new_conversation("alice").conversation
    for m in msgs:
        assert any(isinstance(ev, ReplyEnd) for ev in conv.send(m))
    return conv


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
    conv, _, _ = open_conv(sess, conv.id)
    assert list(conv.engine.tokens) == conv.r.tokens()
    conv.close()


def watch_state_io(mp: pytest.MonkeyPatch, note: Callable[[str], None]) -> None:
    """``note("write")`` / ``note("fsync")`` for every write and fsync of a ``state.kv`` file while ``mp`` lasts."""
    real_write, real_fsync = os.write, os.fsync

    def is_state(fd: int) -> bool:
        try:
            return os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == "state.kv"
        except OSError:
            return False

    def write(fd: int, data: Any) -> int:
        if is_state(fd):
            note("write")
        return real_write(fd, data)

    def fsync(fd: Any) -> None:
        if isinstance(fd, int) and is_state(fd):
            note("fsync")
        real_fsync(fd)

    mp.setattr(os, "write", write)
    mp.setattr(os, "fsync", fsync)


def test_a_long_replys_mid_reply_save_is_not_fsynced_and_the_reply_covers_it(sess: Any, golden: dict[str, Any]) -> None:
    # A reply that runs long (LATE_SAVE_SECONDS; here from its second token) writes the user message's cells
    # while it streams (so a killed process finds them) but does not fsync them there, between two decodes.
    # The reply's own append fsyncs the file, which covers them.
    from chatcli.core import conversation as conversation_mod

    cid = install(golden)
    conv, _, _ = open_conv(sess, cid)
    seen: list[tuple[str, int]] = []  # ("write" | "fsync", ReplyText events seen so far), state.kv only
    texts = 0
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(conversation_mod, "LATE_SAVE_SECONDS", 0.0)
            watch_state_io(mp, lambda what: seen.append((what, texts)))
            for ev in conv.send(MSGS[2]):
                if type(ev).__name__ == "ReplyText":
                    texts += 1
                    if texts == 3:
                        # Written (a kill now keeps the message's cells) but not fsynced yet.
                        assert ("write", 2) in seen and not any(w == "fsync" for w, _ in seen), seen
        assert texts > 2
        last_write = max(i for i, (what, _) in enumerate(seen) if what == "write")
        assert any(what == "fsync" for what, _ in seen[last_write:]), seen  # the end is durable
        saved = state_tokens(conv.dir.state_path)
        assert saved == sess.engine.tokens
    finally:
        conv.close()


def test_a_held_commit_writes_the_turn_without_an_fsync(sess: Any, golden: dict[str, Any]) -> None:
    # A server's commit after a reply's end (``defer_writes``): its next request waits for it, so the
    # records are written (a killed process finds them) but not fsynced (the state file is a cache).
    cid = install(golden)
    conv, _, _ = open_conv(sess, cid)
    seen: list[str] = []

    try:
        conv.defer_writes()
        for _ in conv.send(MSGS[2]):
            pass
        with pytest.MonkeyPatch.context() as mp:
            watch_state_io(mp, seen.append)
            conv.commit()
        assert "write" in seen and "fsync" not in seen, seen
        assert state_tokens(conv.dir.state_path) == sess.engine.tokens  # the whole turn is in the file
    finally:
        conv.close()


def test_tok_s_counts_the_tokens_after_the_first_over_first_to_last_shown(sess: Any) -> None:
    """The stats line's tok/s is llama-server's (and the benchmarks'): tokens after the first over the time
    from the first token shown to the last one. A consumer that takes 0.3 s over the first token (as the
    user message's save between the first two tokens does, shorter) is in it; what follows the last token
    shown (its decode, the closing, the save: a consumer's 0.3 s there) is not, and neither is the first
    token's sampling (the time to first token)."""
    import time

    from chatcli.core.events import ReplyText

    conv = new_conv(sess)
    conv.max_tokens = 12
    try:
        seen: list[float] = []
        end = None
        for ev in conv.send("Count from 1 to 50, separated by commas."):
            if isinstance(ev, ReplyText):
                seen.append(time.perf_counter())
                if len(seen) in (1, conv.max_tokens):
                    time.sleep(0.3)
            elif isinstance(ev, ReplyEnd):
                end = ev
        assert end is not None and end.stats.stop_reason == "length"
        st = end.stats
        assert st.n_generated == len(seen) == 12  # no end of turn: every token was shown as text
        span = seen[-1] - seen[0]
        assert st.decode_seconds == pytest.approx(span, abs=0.005) and st.gen_seconds > span + 0.3
        assert st.tokens_per_second == pytest.approx(11 / st.decode_seconds)
        assert conv.session_stats.tokens_per_second == pytest.approx(st.tokens_per_second)
    finally:
        conv.close()


# -- /redo and /alt read back only cells computed on the current history -------------------------------------


def test_put_back_reads_back_no_cells_computed_after_other_tokens(sess: Any) -> None:
    """``put_back`` (/redo, /alt, and the resume's read-back) reads dead cells back only when the tokens
    before them are those they were computed after (each record's HISTORY): the reply's cells, at the same
    positions and of the same tokens but after another user message, are evaluated instead, and the context
    then gives the logits of one that never had the first message, bit for bit."""
    from chatcli.core.steps import evaluate, finish

    conv = new_conv(sess, MSGS[0])
    eng = sess.engine
    user, answer = conv.messages[-2], conv.messages[-1]
    other = list(user.tokens)
    other[len(other) // 2] = (other[len(other) // 2] + 1) % eng.n_vocab  # another message, of the same length
    finish(conv.log.rollback(user.p0))
    assert finish(conv.log.put_back(other)) == 0  # nothing saved holds it: evaluated
    reused = finish(conv.log.put_back(list(answer.tokens)))
    assert reused == 0, "the reply's cells, computed after the first message, were read back"
    eng.ensure_logits()  # the last token evaluated again on the cells before it
    here = eng.logits().copy()
    finish(conv.log.rollback(user.p0, persist=False))
    finish(evaluate(eng, other, "reference"))
    finish(evaluate(eng, list(answer.tokens), "reference"))
    eng.ensure_logits()
    assert np.array_equal(here, eng.logits())
    # The cells just evaluated carry their own history: put back after the same message they are read back.
    finish(conv.log.rollback(user.p0))
    assert finish(conv.log.put_back(other)) == len(other)
    assert finish(conv.log.put_back(list(answer.tokens))) == len(answer.tokens)
    conv.close()


def test_a_state_file_without_histories_loads_and_redoes_evaluating_nothing(sess: Any) -> None:
    """A state file written before HISTORY records (each record's history dropped here) still resumes with
    nothing evaluated, and /undo then /redo reads its cells back: a record without a history is read back
    by its positions and tokens, as before."""
    conv = new_conv(sess, MSGS[0], MSGS[1])
    cid, path, want = conv.id, conv.dir.state_path, list(sess.engine.tokens)
    conv.close()
    data = path.read_bytes()
    recs = sf.scan(path).records
    assert sf.HISTORY in [r.kind for r in recs]
    path.write_bytes(b"".join(data[r.offset:r.offset + r.size] for r in recs if r.kind != sf.HISTORY))
    assert sf.HISTORY not in [r.kind for r in sf.scan(path).records] and not sf.scan(path).problem
    before = sess.engine.n_evaluated_total
    conv, report, _ = open_conv(sess, cid)
    assert report.reevaluated == 0 and sess.engine.n_evaluated_total == before, report.reason
    conv.undo(1)
    assert conv.redo().n_eval == 0 and sess.engine.tokens == want and sess.engine.n_evaluated_total == before
    conv.close()
