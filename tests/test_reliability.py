"""What chatcli promises, proven on the real model: crash safety, corruption, locks, bad input, privacy, signals.

docs/PROMISES.md lists every promise with the test that proves it. Crash tests reuse bench/faults.py (which
runs many more kill points); the corruption and disk-full tests drive the core API in-process on one engine,
against copies of one two-exchange conversation made once per module.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from chatcli.backends.llamacpp import EngineError
from chatcli.cli.app import app
from chatcli.config.settings import get_paths
from chatcli.core.conversation import Conversation, ConversationError, Notice, ReplyEnd, ResumeReport
from chatcli.core.files.store import ConversationDir, ConversationStore, LockedError, StoreError
from chatcli.core.kv import records as sf

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("chatcli_faults", REPO / "bench" / "faults.py")
assert _spec is not None and _spec.loader is not None
faults = importlib.util.module_from_spec(_spec)
sys.modules["chatcli_faults"] = faults
_spec.loader.exec_module(faults)

runner = CliRunner()
MSGS = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?"]
N_CTX = 1024
GUARD = 600  # seconds: only ever a hang guard for subprocesses, never an assertion about speed


@pytest.fixture(autouse=True)
def one_thread(chatcli_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One llama.cpp thread: on a busy 2-core machine two threads spin-waiting on each other run ~5x slower."""
    monkeypatch.setenv("CHATCLI_THREADS", "1")


# ----------------------------------------------------------------------------------------------- helpers


def open_conv(session: Any, cid: str) -> tuple[Conversation, ResumeReport, list[str]]:
    conv = report = None
    notices: list[str] = []
    for ev in session.open_conversation(cid):
        if isinstance(ev, Conversation):
            conv = ev
        elif isinstance(ev, ResumeReport):
            report = ev
        elif isinstance(ev, Notice):
            notices.append(ev.text)
    assert conv is not None and report is not None
    return conv, report, notices


def reply(events: Iterator[Any]) -> ReplyEnd:
    ends = [ev for ev in events if isinstance(ev, ReplyEnd)]
    assert ends, "no reply"
    return ends[-1]


def state_tokens(path: Path) -> list[int] | None:
    """The tokens the state file's live cells hold, or None if it does not scan clean."""
    res = sf.scan(path)
    if res.header is None or res.dropped_bytes:
        return None
    chunks, _, _ = res.live()
    out: list[int] = []
    for ch in chunks:
        toks, _ = sf.split_cells(sf.read_payload(path, ch.record), ch.record.p1 - ch.record.p0)
        out.extend(toks[: ch.end - ch.record.p0])
    return out


def conv_path(cid: str) -> Path:
    return get_paths().conversations_dir / cid


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()}
    env.update(PYTHONUNBUFFERED="1", NO_COLOR="1", **extra)
    return env


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def wait_for(predicate: Any, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll until ``predicate()``; a hang guard, not a timing assertion."""
    deadline = time.monotonic() + GUARD
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


# ------------------------------------------------------------------------------- one conversation, reused


@pytest.fixture(scope="module")
def base_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.drive import isolated_session

    session = isolated_session(tmp_path_factory.mktemp("base") / "home", threads=1, n_ctx=N_CTX, max_tokens=12, reserve=64)
    yield session
    session.close()


@pytest.fixture
def sess(base_session: Any, chatcli_home: Path) -> Any:
    """The module's session (its engine) bound to this test's CHATCLI_HOME."""
    from tests.drive import rebind

    return rebind(base_session)


@pytest.fixture(scope="module")
def golden(base_session: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A greedy two-exchange conversation saved as a folder, what came next, and another conversation."""
    root = tmp_path_factory.mktemp("golden")
    session = dataclasses.replace(base_session, store=ConversationStore(root / "made"))
    out: dict[str, Any] = {}
    for name, msgs in (("main", MSGS[:2]), ("other", ["Tell me a joke.", "Another one, please."])):
        conv = next(ev for ev in session.new_conversation("alice") if isinstance(ev, Conversation))
        for m in msgs:
            reply(conv.send(m))
        shutil.copytree(conv.dir.path, root / name)
        out[name] = {"path": root / name, "id": conv.id, "tokens": list(session.engine.tokens),
                     "messages": [(m.role, m.text, list(m.tokens)) for m in conv.messages]}
        if name == "main":
            end = reply(conv.send(MSGS[2]))
            out["next_reply"] = list(end.message.tokens)
            assert conv.turn_logits is not None
            out["next_logits"] = conv.turn_logits[1].copy()
        conv.close()
    return out


def install(golden: dict[str, Any], which: str = "main") -> str:
    """Copy a golden conversation into this test's CHATCLI_HOME; returns its id."""
    g = golden[which]
    dest = get_paths().conversations_dir / g["id"]
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    shutil.copytree(g["path"], dest)
    return g["id"]


# ================================================================================================ crashes


# bench/faults.py's session without its last line: it still compacts and shifts, a little faster.
CRASH_SCRIPT = faults.SCRIPT[:-1]


@pytest.fixture(scope="module")
def fault_ref(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The scripted session, uninterrupted (with turns, /undo compaction and a context shift)."""
    return faults.reference(tmp_path_factory.mktemp("faults"), CRASH_SCRIPT)


KILL_POINTS = {
    # SIGKILL half-way through appending the cells of the second reply: a torn state record.
    "torn-state-append": ("write:state", "torn", "message:assistant", 2, 0),
    # SIGKILL while the third reply streams, after five decodes.
    "mid-reply": ("decode", "before", "message:user", 3, 5),
    # SIGKILL half-way through writing the compacted state file after /undo (temp file of an atomic rewrite).
    "mid-compaction": ("write:state_tmp", "torn", "truncate:undo", 1, 0),
    # SIGKILL after the oldest exchange left the context, before the snapshot that follows it is written.
    "after-shift": ("shift", "after", "shift:", 1, 0),
}  # (torn transcript lines: bench/faults.py and test_torn_last_transcript_line_is_dropped_reported_and_repaired)


@pytest.mark.parametrize("name", list(KILL_POINTS))
def test_sigkill_loses_at_most_the_reply_in_flight(name: str, fault_ref: Any, tmp_path: Path) -> None:
    event, phase, note, k, skip = KILL_POINTS[name]
    if event == "shift":
        point = faults.KillPoint(f"shift #1 {phase}", {"event": "shift", "n": 1, "phase": phase})
    else:
        point = faults.point_after(fault_ref, event, phase, note, k, skip)
    out = faults.run_point(fault_ref, point, tmp_path, CRASH_SCRIPT)
    assert out.killed, point.label
    assert out.problems == [], (point.label, out.problems)
    assert out.lost == 0
    if name in ("mid-reply", "mid-compaction"):
        # The state on disk was complete for everything the transcript holds: restored, not re-evaluated,
        # and the conversation continues exactly as if it had never been killed.
        assert out.intact and out.identical, point.label
    if name == "torn-state-append":
        assert not out.intact  # the torn record was detected and its cells re-evaluated


def test_remaining_lines_after_a_kill(fault_ref: Any) -> None:
    """The harness itself: which scripted lines a resume must still send."""
    script = CRASH_SCRIPT
    assert faults.remaining_lines(fault_ref, script, 0) == (script, False)
    first_user_only = fault_ref.line_spans[0][0] + 1
    assert faults.remaining_lines(fault_ref, script, first_user_only) == (script[1:], True)
    assert faults.remaining_lines(fault_ref, script, len(fault_ref.events)) == ([], False)


# ============================================================================================= corruption


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
        except (ConversationError, StoreError, EngineError) as exc:
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


@pytest.mark.parametrize("damage", ["garbage", "missing"])
def test_unreadable_metadata_is_a_one_line_error(damage: str, golden: dict[str, Any]) -> None:
    cid = install(golden)
    meta = conv_path(cid) / "meta.json"
    if damage == "garbage":
        meta.write_bytes(b"\x00{not json")
    else:
        meta.unlink()
    for cmd in (["show", cid], ["resume", cid], ["export", cid]):
        result = runner.invoke(app, cmd, input="")
        assert result.exit_code == 2, (cmd, result.stderr)
        assert cid in one_line(result.stderr)


# ============================================================================================== disk full


class DiskFull:
    """os.write that fills the disk for chosen files: the first write gets half its bytes in, then ENOSPC."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.real = os.write
        self.failures = 0

    def _target(self, fd: int) -> bool:
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return False
        return any(name == n or (name.startswith(f".{n}.") and name.endswith(".tmp")) for n in self.names)

    def __call__(self, fd: int, data: Any) -> int:
        if not self._target(fd):
            return self.real(fd, data)
        raw = bytes(data)
        if len(raw) > 1 and not getattr(self, "_half_done", False):
            self._half_done = True
            return self.real(fd, raw[: len(raw) // 2])  # a short write, as when the disk fills up mid-way
        self._half_done = False
        self.failures += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


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

        real = store_mod.append_line_durably

        def fail_on_reply(path: Path, line: str) -> None:
            if '"role":"assistant"' in line:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(path, line)

        with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError):
            mp.setattr(store_mod, "append_line_durably", fail_on_reply)
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


# ============================================================================================ concurrency


def test_open_conversation_is_locked_and_a_killed_holder_never_blocks(golden: dict[str, Any], tmp_path: Path) -> None:
    cid = install(golden)
    chatcli = faults.chatcli_exe()
    err = tmp_path / "holder.err"
    with err.open("wb") as fe:
        holder = subprocess.Popen([*chatcli, "resume", cid], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                  stderr=fe, env=cli_env())
    try:
        wait_for(lambda: "resumed" in err.read_text(), "the holder to open the conversation", holder)
        for cmd in (["resume", cid], ["regen", cid], ["rm", "--yes", cid]):
            proc = subprocess.run([*chatcli, *cmd], input="", capture_output=True, text=True, env=cli_env(),
                                  timeout=GUARD)
            assert proc.returncode != 0, cmd
            assert f"is open in process {holder.pid}" in one_line(proc.stderr), cmd
        with pytest.raises(LockedError, match=str(holder.pid)):
            ConversationDir(conv_path(cid)).lock()
    finally:
        holder.kill()  # SIGKILL: no chance to unlock
        holder.wait()
    proc = subprocess.run([*chatcli, "resume", cid], input="", capture_output=True, text=True, env=cli_env(),
                          timeout=GUARD)
    assert proc.returncode == 0, proc.stderr
    assert "resumed" in proc.stderr


# ============================================================================================== bad input


BAD_IDS = ["../x", "a/b", "..", ".", "/etc", "a\\b", "a\x00b", "ABC", "x" * 300, "nosuch"]


@pytest.mark.parametrize("cmd", ["resume", "show", "regen", "export", "fork", "rm"])
def test_bad_conversation_ids_are_one_line_exit_2(cmd: str, tmp_path: Path, chatcli_home: Path) -> None:
    def tree() -> set[Path]:
        return set(tmp_path.rglob("*"))

    before = tree()
    for bad in BAD_IDS:
        args = [cmd, bad] + (["--yes"] if cmd == "rm" else [])
        result = runner.invoke(app, args, input="")
        assert result.exit_code == 2, (cmd, bad, result.stderr, result.exception)
        line = one_line(result.stderr)
        assert "conversation" in line and ("invalid" in line or "no conversation" in line), line
    new = tree() - before
    # Nothing was created by following the id: at most chatcli's own (empty) directories.
    assert all(p.is_dir() and (p == chatcli_home or chatcli_home in p.parents) for p in new), new
    assert not [p for p in chatcli_home.rglob("*") if p.is_file()] if chatcli_home.exists() else True


def test_malformed_user_persona_names_file_and_line_before_loading(
    chatcli_home: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    loads: list[object] = []
    monkeypatch.setattr("chatcli.session.Engine", lambda *a, **k: loads.append(a))
    personas = chatcli_home / "config" / "personas"
    personas.mkdir(parents=True)
    bad = personas / "x.toml"
    bad.write_text('name = "x"\nsystem = "unterminated\n')
    result = runner.invoke(app, ["talk", "--persona", "x"], input="hi\n")
    assert result.exit_code == 2
    line = one_line(result.stderr)
    assert str(bad) in line and "line 2" in line
    bad.write_bytes(b'system = "caf\xe9"\n')
    result = runner.invoke(app, ["talk", "--persona", "x"], input="hi\n")
    assert result.exit_code == 2 and str(bad) in one_line(result.stderr)
    assert loads == []


def test_conversation_whose_persona_file_broke_still_resumes(sess: Any, golden: dict[str, Any]) -> None:
    cid = install(golden)
    personas = get_paths().personas_dir
    personas.mkdir(parents=True, exist_ok=True)
    (personas / "alice.toml").write_text("system = [unclosed\n")
    conv, report, _ = open_conv(sess, cid)
    conv.close()
    assert report.reevaluated == 0 and sess.engine.tokens == golden["main"]["tokens"]


def test_huge_line_and_non_utf8_bytes_piped_to_talk(chatcli_home: Path) -> None:
    stdin = (b"caf\xe9 cr\xe8me \xff\xfe?\n"  # Latin-1, not UTF-8
             + b"word " * 210_000 + b"\n"  # ~1 MB on one line
             + b"What is two plus two?\n")
    proc = subprocess.run([*faults.chatcli_exe(), "talk", "--temperature", "0", "--max-tokens", "6", "--n-ctx", "1024"],
                          input=stdin, capture_output=True, env=cli_env(), timeout=GUARD)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1, err  # a message was refused: a script can tell (issue #24 item 19)
    refusals = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(refusals) == 1 and "too long" in refusals[0], err  # the user is told it was not sent
    assert len(refusals[0]) < 300  # one line, not an echo of the megabyte
    (conv,) = list((chatcli_home / "data" / "conversations").iterdir())
    events = ConversationDir(conv).read_transcript().events
    users = [e["text"] for e in events if e.get("role") == "user"]
    assert users == ["caf\ufffd cr\ufffdme \ufffd\ufffd?", "What is two plus two?"]
    assert [e["role"] for e in events if e["type"] == "message"] == ["user", "assistant", "user", "assistant"]


# ================================================================================================ privacy


@pytest.fixture(scope="module")
def private_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A talk and a resume with HOME, TMPDIR, XDG dirs and the working directory all pointing at empty dirs."""
    base = tmp_path_factory.mktemp("privacy")
    dirs = {k: base / k for k in ("chatcli_home", "home", "tmp", "xdg", "cwd")}
    for k in ("home", "tmp", "cwd"):
        dirs[k].mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATCLI_", "XDG_"))}
    env.update(CHATCLI_HOME=str(dirs["chatcli_home"]), HOME=str(dirs["home"]), TMPDIR=str(dirs["tmp"]),
               NO_COLOR="1", CHATCLI_THREADS="1", PYTHONUNBUFFERED="1",
               **{f"XDG_{k}_HOME": str(dirs["xdg"] / k.lower()) for k in ("DATA", "CONFIG", "CACHE", "STATE")})
    chatcli = faults.chatcli_exe()
    opts = ["--temperature", "0", "--max-tokens", "4"]
    talk = subprocess.run([*chatcli, "talk", *opts], input="Hi!\n", capture_output=True, text=True, env=env,
                          cwd=dirs["cwd"], timeout=GUARD)
    assert talk.returncode == 0, talk.stderr
    cid = re.search(r"chatcli resume (\w+)", talk.stderr)
    assert cid, talk.stderr
    for cmd in (["resume", cid.group(1), *opts], ["ls"], ["show", cid.group(1)], ["export", cid.group(1)]):
        proc = subprocess.run([*chatcli, *cmd], input="Bye!\n", capture_output=True, text=True, env=env,
                              cwd=dirs["cwd"], timeout=GUARD)
        assert proc.returncode == 0, (cmd, proc.stderr)
    return dirs


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def test_data_is_private_and_nothing_is_written_elsewhere(private_run: dict[str, Path]) -> None:
    home = private_run["chatcli_home"]
    for k in ("home", "tmp", "cwd"):
        assert list(private_run[k].iterdir()) == [], k  # HOME, TMPDIR and the working directory untouched
    assert not private_run["xdg"].exists()  # CHATCLI_HOME wins over the platform dirs
    assert {p.name for p in home.iterdir()} <= {"data", "cache", "config"}
    modes = _modes(home)
    files = {p: m for p, m in modes.items() if (home / p).is_file()}
    assert files and all(m == 0o600 for m in files.values()), files
    data = _modes(home / "data")
    assert all(m == 0o700 for p, m in data.items() if (home / "data" / p).is_dir()), data
    assert any(p.endswith("transcript.jsonl") for p in files)


def test_every_directory_chatcli_creates_is_private(private_run: dict[str, Path]) -> None:
    home = private_run["chatcli_home"]
    dirs = {p: m for p, m in _modes(home).items() if (home / p).is_dir()}
    assert all(m == 0o700 for m in dirs.values()), dirs


def test_prompt_history_file_is_private() -> None:
    """The terminal prompt's history holds everything the user typed."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from chatcli.core.files.fsutil import ensure_private_dir
    from chatcli.repl.loop import TerminalIO

    class AnyRepl:  # TerminalIO only asks the REPL for callbacks (toolbar, hints)
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: ""

    path = get_paths().history_file
    ensure_private_dir(path.parent)
    with create_pipe_input() as pipe:
        tio = TerminalIO(AnyRepl(), history_file=path, input=pipe, output=DummyOutput())  # type: ignore[arg-type]
        pipe.send_text("my secret message\r")
        assert tio.read() == "my secret message"
    assert "my secret message" in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_no_pickle_eval_or_exec_of_anything() -> None:
    banned = re.compile(r"\bpickle\b|\bmarshal\b|\bshelve\b|allow_pickle\s*=\s*True|(?<![.\w])(?<!def )(eval|exec)\s*\(")
    hits = []
    for src in sorted((REPO / "chatcli").rglob("*.py")):
        for n, line in enumerate(src.read_text("utf-8").splitlines(), 1):
            if banned.search(line.split("#", 1)[0]):
                hits.append(f"{src.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == []
    assert banned.search("x = pickle.loads(data)") and banned.search("eval(text)") and not banned.search("eng.eval(t)")


# ================================================================================================ signals


def _start_talk(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = tmp_path / "talk.out", tmp_path / "talk.err"
    with out.open("wb") as fo, err.open("wb") as fe:
        proc = subprocess.Popen([*faults.chatcli_exe(), "talk", "--temperature", "0", "--n-ctx", str(N_CTX), *extra],
                                stdin=subprocess.PIPE, stdout=fo, stderr=fe, env=cli_env())
    return proc, out, err


def _send(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


def _stats_lines(err: Path) -> int:
    return faults.completed_replies(err.read_text("utf-8", "replace"))


def _only_conversation(home: Path) -> Path:
    (conv,) = list((home / "data" / "conversations").iterdir())
    return conv


def test_sigterm_at_the_prompt_saves_and_exits_0(tmp_path: Path, chatcli_home: Path, sess: Any) -> None:
    proc, _, err = _start_talk(tmp_path, "--max-tokens", "8")
    try:
        _send(proc, MSGS[0])
        wait_for(lambda: _stats_lines(err) == 1, "the first reply", proc)
        proc.send_signal(signal.SIGTERM)  # stdin still open: the REPL is waiting for the next line
        assert proc.wait(timeout=GUARD) == 0, err.read_text()
    finally:
        proc.kill()
    assert "saved" in err.read_text()
    conv = _only_conversation(chatcli_home)
    assert faults.check_disk(conv) == []
    events = ConversationDir(conv).read_transcript().events
    assert next((e["role"], e["text"]) for e in events if e["type"] == "message") == ("user", MSGS[0])
    c, report, _ = open_conv(sess, conv.name)  # the lock was released; everything restores from the file
    c.close()
    assert report.reevaluated == 0 and len(c.messages) == 2


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_signal_during_a_reply_keeps_completed_turns_and_exits_0(
    sig: int, tmp_path: Path, chatcli_home: Path, sess: Any,
) -> None:
    proc, out, err = _start_talk(tmp_path, "--max-tokens", "200")
    try:
        _send(proc, MSGS[0])
        wait_for(lambda: _stats_lines(err) == 1, "the first reply", proc)
        shown = out.stat().st_size
        _send(proc, "Tell me a very long story about a dragon who loves books.")
        wait_for(lambda: out.stat().st_size > shown + 10, "the second reply to stream", proc)
        proc.send_signal(sig)
        # 0: the documented exit code (the REPL stops the reply, saves it and leaves the loop).
        assert proc.wait(timeout=GUARD) == 0, err.read_text()
    finally:
        proc.kill()
    conv = _only_conversation(chatcli_home)
    assert faults.check_disk(conv) == []
    msgs = [e for e in ConversationDir(conv).read_transcript().events if e["type"] == "message"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]  # the partial reply is kept
    assert msgs[3]["text"]
    c, report, _ = open_conv(sess, conv.name)
    c.close()
    assert report.reevaluated == 0 and len(c.messages) == 4
