"""repl/loop.py as a real process: what it does with piped bytes that are not text or far too long, and
with SIGTERM and SIGHUP (docs/PROMISES.md 9, 11)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from chatcli.core.files.store import ConversationDir
from tests.golden import GUARD, MSGS, N_CTX, cli_env, faults, open_conv, wait_for

# The shared fixtures (sess, golden: tests/golden.py, a plugin of tests/conftest.py), on one llama.cpp thread.
pytestmark = pytest.mark.usefixtures("one_thread")


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
