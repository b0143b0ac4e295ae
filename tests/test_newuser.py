"""Defects a new user met on the screen (README top to bottom in a real terminal), each pinned here."""

from __future__ import annotations

import tomllib

import pytest
from typer.testing import CliRunner

from chatcli.cli import app

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
    after = res.stderr.split("redone 1 exchange(s): 0 tokens evaluated", 1)[1]
    assert "you: Name a fruit." in after and "assistant: " in after


def test_serve_warns_when_reachable_from_other_machines_without_a_key() -> None:
    from chatcli.server.run import exposure_warning

    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert exposure_warning(host, None) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "gpu-box.lan"):
        warning = exposure_warning(host, None)
        assert warning is not None and "--api-key" in warning
        assert exposure_warning(host, "a-long-enough-key") is None
