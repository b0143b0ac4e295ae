"""Defects a new user met on the screen (README top to bottom in a real terminal), each pinned here."""

from __future__ import annotations

import os
import time
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatcli.cli.app import app

runner = CliRunner()


def test_config_show_prints_toml_that_can_be_pasted_and_masks_both_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """It printed Python reprs (`model = None`, `plain = False`: not TOML) and showed server_api_key."""
    monkeypatch.setenv("CHATCLI_API_KEY", "serve-secret-1234")
    monkeypatch.setenv("CHATCLI_SERVER_API_KEY", "remote-secret-5678")
    monkeypatch.setenv("CHATCLI_PERSONA", 'co"der')
    res = runner.invoke(app, ["config", "show"])
    assert res.exit_code == 0, res.output
    assert "1234" not in res.stdout and "5678" not in res.stdout
    doc = tomllib.loads(res.stdout)  # every line is TOML (unset settings are comments)
    assert doc["plain"] is False and doc["n_ctx"] == 4096 and doc["persona"] == 'co"der'
    assert doc["api_key"] == doc["server_api_key"] == "***"
    assert "model" not in doc and "# model = (not set)  # default" in res.stdout


def test_a_refused_api_key_is_not_echoed() -> None:
    """`chatcli serve --api-key s3cret` printed the key back in its error line."""
    res = runner.invoke(app, ["serve", "--api-key", "s3cret"])
    assert res.exit_code != 0
    assert "s3cret" not in res.output and "at least 8 characters (got 6 characters)" in res.output


def test_redo_shows_what_came_back() -> None:
    """/redo printed only the last reply: the message it brought back was not on the screen."""
    res = runner.invoke(app, ["talk", "--plain", "--temperature", "0", "--max-tokens", "8"],
                        input="Name a fruit.\n/undo\n/redo\n/exit\n")
    assert res.exit_code == 0, res.output
    after = res.stderr.split("redone 1 exchange: 0 tokens evaluated", 1)[1]
    assert "you: Name a fruit." in after and "assistant: " in after


def test_serve_warns_when_reachable_from_other_machines_without_a_key() -> None:
    from chatcli.server.run import exposure_warning

    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert exposure_warning(host, None) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "gpu-box.lan"):
        warning = exposure_warning(host, None)
        assert warning is not None and "--api-key" in warning
        assert exposure_warning(host, "a-long-enough-key") is None


def test_ctrl_c_while_a_long_paste_is_read_stops_reading_and_gives_it_back(chatcli_home: Path, tmp_path: Path) -> None:
    """Ctrl-C during "reading your message" (a long paste: tens of seconds on a CPU) did nothing until the
    whole message had been read. It now stops at the next batch; the message leaves the context and comes
    back to the prompt, nothing lost."""
    pytest.importorskip("pexpect")
    pytest.importorskip("pyte")
    from tests.test_terminal import Terminal

    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS", "LINES")}
    env.update(CHATCLI_HOME=str(chatcli_home), TERM="xterm-256color", LANG="C.UTF-8", CHATCLI_THREADS="1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    paste = " ".join(f"Item {i} is a note about boats and harbours." for i in range(250))  # ~3,400 tokens
    t = Terminal(["talk", "--persona", "alice"], env, tmp_path)
    try:
        t.wait(t.prompt_ready, timeout=60)
        conv_id = next(ln for ln in t.lines() if ln.startswith("conversation ")).split()[1]
        t.send("\x1b[200~" + paste + "\x1b[201~")
        t.wait("Item 249 is a note about boats and harbours.", timeout=30)
        t.send("\r")
        t.wait("reading your message", timeout=60)
        t.send("\x03")
        t.wait("stopped reading your message", timeout=60)
        # The message is back in the prompt, under the notice (a long input shows its end, where the cursor is).
        t.wait(lambda: "Item 249 is a note about boats and harbours." in t.text().split("stopped reading", 1)[1]
               and "ctx " in t.display()[-1], timeout=30)
        assert "tok evaluated" not in t.text()  # no reply: the reading stopped before the end
        time.sleep(1.1)  # not a double Ctrl-C
        t.send("\x03")  # clears the line (Ctrl-D on a non-empty line does not exit)
        t.wait(lambda: "Ctrl-C again to exit" in t.display()[-1])
        t.send("\x04")
        t.child.expect(pexpect_eof(), timeout=30)
    finally:
        t.close()
    from chatcli.core.files.store import ConversationDir
    from chatcli.core.transcript import replay_events

    conv = ConversationDir(chatcli_home / "data" / "conversations" / conv_id)
    events = conv.read_transcript().events
    assert not replay_events(events).active  # not in the conversation...
    assert any(e.get("role") == "user" and e.get("text") == paste for e in events)  # ...but never lost
    assert events[-1].get("type") == "truncate" and events[-1].get("reason") == "failed"


def pexpect_eof() -> object:
    import pexpect

    return pexpect.EOF
