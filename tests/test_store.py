"""core/files/store.py: unreadable metadata and bad ids are one line, an open conversation is locked and a
killed holder never blocks (docs/PROMISES.md 6, 8, 9)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from chatcli.cli.app import app
from chatcli.core.files.store import ConversationDir, LockedError
from tests.golden import GUARD, cli_env, conv_path, faults, install, one_line, runner, wait_for

# The shared fixtures (sess, golden: tests/golden.py, a plugin of tests/conftest.py), on one llama.cpp thread.
pytestmark = pytest.mark.usefixtures("one_thread")


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
