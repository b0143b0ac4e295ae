"""Conversations on a real llama-server, end to end: chatcli's core and CLI with the remote backend.

One server per module (bundled SmolLM2, loopback, temporary --slot-save-path); tests that kill it or need
another one start their own processes and stop them. Claims are checked with what the server reports:
prompt tokens it evaluated vs reused (its ``timings``), and the greedy tokens it sampled.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatcli.cli.app import app
from chatcli.core.backend import BackendError
from chatcli.core.conversation import Conversation
from chatcli.core.events import ReplyText, ResumeReport
from chatcli.session import Session
from tests.drive import drain
from tests.remote_drive import alive, remote_session, reopen_after_a_crash, say
from tests.remote_server import SKIP_REASON, LlamaServer, running_server, server_binary

pytestmark = pytest.mark.skipif(server_binary() is None, reason=SKIP_REASON)

N_CTX = 2048
MSGS = ["Hi! What is your name?", "Name one colour.", "And a fruit?"]
NEXT = "Thanks. Now tell me one short fact."


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    yield from running_server(model_path, tmp_path_factory.mktemp("llama-server-e2e"), N_CTX)


@pytest.fixture
def live(server: LlamaServer) -> LlamaServer:
    return alive(server)


def new_conversation(session: Session) -> Conversation:
    conv, _, _ = drain(session.new_conversation("alice"))
    assert conv is not None
    return conv


def open_conversation(session: Session, conv_id: str) -> tuple[Conversation, ResumeReport]:
    conv, report, _ = drain(session.open_conversation(conv_id))
    assert conv is not None and report is not None
    return conv, report


def user_tokens(session: Session, conv: Conversation, text: str) -> int:
    return len(session.engine.tokenize(session.template.user_turn(conv.history(), text)))


def test_resume_after_a_server_restart_restores_the_slot(live: LlamaServer) -> None:
    # Uninterrupted: four turns on one server.
    s1 = remote_session(live.url)
    a = new_conversation(s1)
    a_replies = [say(a, m).message.tokens for m in MSGS]
    a_fourth = say(a, NEXT)
    a.close()
    # Interrupted: three turns, the server is killed and a new one started, then `resume` and the fourth.
    b = new_conversation(s1)
    b_replies = [say(b, m).message.tokens for m in MSGS]
    assert b_replies == a_replies
    b_id = b.id
    b.close()
    s1.close()
    s2, b, report = reopen_after_a_crash(live, b_id)
    n_new = user_tokens(s2, b, NEXT)
    fourth = say(b, NEXT)
    # The server found the whole history in the restored slot: it evaluated the new message only.
    assert fourth.stats.server_evaluated is not None and fourth.stats.server_evaluated <= n_new
    assert fourth.stats.server_cached == report.restored_tokens
    assert fourth.message.tokens == a_fourth.message.tokens
    # /regen: the slot holds everything up to the reply, so the server re-evaluates at most one token.
    _, _, ends = drain(b.regen())
    assert ends[-1].stats.server_evaluated is not None and ends[-1].stats.server_evaluated <= 1
    assert ends[-1].message.tokens == fourth.message.tokens  # greedy: the same reply again
    b.close()
    s2.close()


def test_attention_model_keeps_one_slot_save_per_turn(live: LlamaServer) -> None:
    # The probe finds a slot that cuts back: no regenerate-point saves (issue #20: those are for recurrent
    # and hybrid models, tests/test_remote_hybrid.py), and /regen still costs the server one token.
    session = remote_session(live.url)
    assert session.engine.caps.truncate is True
    conv = new_conversation(session)
    say(conv, MSGS[0])
    assert "regen" not in conv.meta["checkpoint"]
    assert live.slot_save_path is not None and not list(live.slot_save_path.glob("*-regen.bin"))
    _, _, ends = drain(conv.regen())
    assert ends[-1].stats.server_evaluated == 1 and ends[-1].stats.reevaluated == 1
    conv.close()
    session.close()


def test_undo_saves_the_shorter_slot_and_resumes_from_it(live: LlamaServer) -> None:
    # The slot still held the undone exchange: the save must first cut it back (it saved the old, longer
    # sequence and failed with "saved 118 tokens instead of 96" before).
    s1 = remote_session(live.url)
    conv = new_conversation(s1)
    for m in MSGS[:2]:
        say(conv, m)
    stats = conv.undo(1)
    assert stats.notices == [] and conv.meta["checkpoint"]["tokens"] == stats.kept == conv.context.n_past
    assert stats.reevaluated == 0  # an attention cache is cut back for free
    conv_id = conv.id
    conv.close()
    s1.close()
    s2, conv, report = reopen_after_a_crash(live, conv_id)
    assert report.restored_tokens == stats.kept
    conv.close()
    s2.close()


def test_server_killed_mid_reply(live: LlamaServer) -> None:
    s1 = remote_session(live.url, max_tokens=200)
    conv = new_conversation(s1)
    say(conv, MSGS[0])
    conv_id = conv.id
    shown = ""
    killer = threading.Thread(target=live.kill)
    with pytest.raises(BackendError) as err:
        for ev in conv.send("Count from one to fifty, in words, separated by commas."):
            if isinstance(ev, ReplyText):
                shown += ev.text
                if len(shown) > 12 and not killer.is_alive() and live.proc is not None:
                    killer.start()
    killer.join()
    msg = str(err.value)
    assert "\n" not in msg and "llama-server" in msg
    # Recorded like a Ctrl-C'd reply: the user's message and what was shown are in the transcript.
    last = conv.messages[-1]
    assert last.role == "assistant" and last.stop == "cancelled" and shown.startswith(last.text[:8])
    assert conv.messages[-2].text.startswith("Count from one")
    conv.close()
    s1.close()
    live.start()
    s2 = remote_session(live.url)
    conv, report = open_conversation(s2, conv_id)
    assert [m.role for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    # The checkpoint of the first exchange is restored; only the interrupted exchange is evaluated again.
    assert report.restored_tokens > 0 and report.reevaluated > 0
    end = say(conv, "Stop counting. Say hello.")
    assert end.message.tokens and end.stats.server_evaluated is not None
    conv.close()
    s2.close()


def test_another_context_size_rebuilds_and_says_so(live: LlamaServer, model_path: Path, tmp_path: Path) -> None:
    s1 = remote_session(live.url)
    conv = new_conversation(s1)
    say(conv, MSGS[0])
    conv_id, n_tokens = conv.id, conv.context.n_past
    conv.close()
    s1.close()
    other = LlamaServer(model_path, n_ctx=N_CTX // 2, slot_save_path=live.slot_save_path, log_path=tmp_path / "other.log")
    other.start()
    try:
        s2 = remote_session(other.url)
        conv, report = open_conversation(s2, conv_id)
        assert report.reason == "saved state is for another model or context size"
        assert report.restored_tokens == 0 and report.reevaluated == n_tokens
        end = say(conv, MSGS[1])
        assert end.message.tokens
        conv.close()
        s2.close()
        # Through the CLI: one line tells it; --server moves the conversation to the other server.
        runner = CliRunner()
        res = runner.invoke(app, ["resume", conv_id, "--server", live.url, "--plain"], input="One more?\n")
        assert res.exit_code == 0, res.stderr
        told = [ln for ln in res.stderr.splitlines() if "another model or context size" in ln]
        assert len(told) == 1, res.stderr
    finally:
        other.stop()


def test_cli_talk_ls_resume_remembers_the_server(live: LlamaServer) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["talk", "--server", live.url, "--temperature", "0", "--max-tokens", "16"],
                        input=f"{MSGS[0]}\n{MSGS[1]}\n")
    assert res.exit_code == 0, res.stderr
    rows = json.loads(runner.invoke(app, ["ls", "--json"]).stdout)
    assert rows[0]["server"] == live.url and rows[0]["turns"] == 2 and rows[0]["state_bytes"] > 0
    table = runner.invoke(app, ["ls"]).stdout
    assert f"\t127.0.0.1:{live.port}\t" in table  # the server column (plain output has no header)
    # No --server: the conversation's own server. The slot was saved: nothing to re-evaluate.
    res = runner.invoke(app, ["resume", "--plain"], input=f"{MSGS[2]}\n")
    assert res.exit_code == 0, res.stderr
    m = re.search(r"restored (\d+) tokens .* re-evaluated (\d+) tokens", res.stderr)
    assert m and int(m[1]) > 0 and int(m[2]) == 0, res.stderr
    res = runner.invoke(app, ["regen", "--plain"])
    assert res.exit_code == 0, res.stderr
    m = re.search(r"server evaluated (\d+), reused (\d+)", res.stderr + res.stdout)
    assert m and int(m[1]) <= 1, res.stderr + res.stdout


def test_server_without_slot_save_path_works_and_says_so_once(model_path: Path, tmp_path: Path) -> None:
    plain = LlamaServer(model_path, n_ctx=1024, slot_save_path=None, log_path=tmp_path / "plain.log").start()
    try:
        runner = CliRunner()
        res = runner.invoke(app, ["talk", "--server", plain.url, "--temperature", "0", "--max-tokens", "12"],
                            input="Hi\nName a colour.\n")
        assert res.exit_code == 0, res.stderr
        assert res.stderr.count("without --slot-save-path") == 1, res.stderr
        res = runner.invoke(app, ["resume", "--plain"], input="And a fruit?\n")
        assert res.exit_code == 0, res.stderr
        assert "no saved state; rebuilt from the transcript's tokens" in res.stderr
    finally:
        plain.stop()


def test_unreachable_server_is_one_line_error(tmp_path: Path) -> None:
    from tests.remote_server import free_port

    runner = CliRunner()
    res = runner.invoke(app, ["talk", "--server", f"http://127.0.0.1:{free_port()}"], input="hi\n")
    assert res.exit_code != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "cannot reach llama-server" in lines[0], res.stderr
