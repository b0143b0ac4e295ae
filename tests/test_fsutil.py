"""core/files/fsutil.py's private dirs and files, seen from a whole session: nothing written outside the
data, cache and config dirs, everything 0700/0600 (docs/PROMISES.md 10)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from chatcli.config.settings import get_paths
from tests.golden import GUARD, faults

# The shared fixtures (sess, golden: tests/golden.py, a plugin of tests/conftest.py), on one llama.cpp thread.
pytestmark = pytest.mark.usefixtures("one_thread")


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
    from chatcli.repl.terminal import TerminalIO

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
