"""chatcli in a real pseudo-terminal: what a person at a 120×40 terminal actually sees.

The process runs under pexpect; its output is fed to pyte, a terminal emulator, and the tests assert on
the emulated screen (and its scrollback), never on escape bytes.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")
pyte = pytest.importorskip("pyte")

ROWS, COLS = 40, 120
CPR = "\x1b[6n"  # prompt_toolkit asks where the cursor is; a real terminal answers
SPINNER = re.compile(r"^[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] ")


class Terminal:
    """A child process on a pty, its output rendered by a pyte screen with scrollback."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.screen = pyte.HistoryScreen(COLS, ROWS, history=2000)
        self.stream = pyte.Stream(self.screen)
        self.child = pexpect.spawn(sys.executable, ["-m", "chatcli", *args], env=env, cwd=str(cwd),
                                   dimensions=(ROWS, COLS), encoding="utf-8", codec_errors="replace")
        self.eof = False

    def pump(self, timeout: float = 0.1) -> None:
        try:
            data = self.child.read_nonblocking(65536, timeout=timeout)
        except pexpect.TIMEOUT:
            return
        except pexpect.EOF:
            self.eof = True
            return
        if CPR in data:
            data = data.replace(CPR, "")
            self.stream.feed(data)
            self.child.send(f"\x1b[{self.screen.cursor.y + 1};{self.screen.cursor.x + 1}R")
        else:
            self.stream.feed(data)

    def lines(self) -> list[str]:
        """Scrollback and screen, as text."""
        hist = ["".join(line[x].data for x in range(COLS)).rstrip() for line in self.screen.history.top]
        return hist + [ln.rstrip() for ln in self.screen.display]

    def text(self) -> str:
        return "\n".join(self.lines())

    def flat(self) -> str:
        return " ".join(self.text().split())

    def display(self) -> list[str]:
        return [ln.rstrip() for ln in self.screen.display]

    def wait(self, what: str | Callable[[], bool], timeout: float = 30.0) -> None:
        # Text is matched with line breaks as spaces: long lines wrap at the terminal's width.
        cond = (lambda: what in self.flat()) if isinstance(what, str) else what
        deadline = time.monotonic() + timeout
        while not cond():
            if self.eof or time.monotonic() > deadline:
                raise AssertionError(f"waited for {what!r}; the screen shows:\n" + "\n".join(self.display()))
            self.pump()

    def count(self, needle: str) -> int:
        return self.text().count(needle)

    def prompt_ready(self) -> bool:
        """The prompt is idle: an empty "›" line and the toolbar under it."""
        disp = self.display()
        return any(ln == "›" for ln in disp) and any("ctx " in ln and " · " in ln for ln in disp[-3:])

    def reply_after(self, prompt_line: str) -> list[str]:
        """Reply lines shown under ``prompt_line`` so far (spinner and toolbar excluded)."""
        disp = self.display()
        if prompt_line not in disp:
            return []
        below = disp[disp.index(prompt_line) + 1:-1]
        return [ln for ln in below if ln.strip() and not SPINNER.match(ln) and "ctx " not in ln]

    def send(self, keys: str) -> None:
        self.child.send(keys)

    def close(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


@pytest.fixture
def term_env(chatcli_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS", "LINES")}
    # One llama.cpp thread: with a thread per core, a busy 2-core machine makes every token wait for
    # preempted threads (seconds per reply instead of ~30 tokens/s).
    env.update(CHATCLI_HOME=str(chatcli_home), TERM="xterm-256color", LANG="C.UTF-8", CHATCLI_THREADS="1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_a_whole_session_in_a_real_terminal(term_env: dict[str, str], tmp_path: Path) -> None:
    t0 = time.monotonic()
    t = Terminal(["talk", "--temperature", "0", "--persona", "alice", "--max-tokens", "400"], term_env, tmp_path)
    try:
        # Start-up: a banner, alice's greeting, the prompt and the toolbar.
        t.wait(t.prompt_ready, timeout=60)
        banner = next(ln for ln in t.lines() if ln.startswith("conversation "))
        conv_id = re.match(r"conversation (\w+) · persona alice", banner).group(1)  # type: ignore[union-attr]
        toolbar = t.display()[-1]
        for needle in ("alice", "ctx ", "/4096", conv_id, "state ", "/help"):
            assert needle in toolbar, (needle, toolbar)

        # Two messages: each reply is followed by its stats line and a fresh prompt.
        t.send("Hi! What is your name?\r")
        t.wait(lambda: t.count("tok evaluated") == 1 and t.prompt_ready())
        t.send("Name one colour.\r")
        t.wait(lambda: t.count("tok evaluated") == 2 and t.prompt_ready())
        assert "› Hi! What is your name?" in t.text() and "› Name one colour." in t.text()

        # /regen: a new reply to the last message; the stats say nothing was re-read.
        t.send("/regen\r")
        t.wait(lambda: t.count("tok evaluated") == 3 and t.prompt_ready())
        assert re.search(r"kept \d+, dropped \d+, re-evaluated 0", t.text())

        # /undo drops the last exchange; /help lists every command, one per line.
        t.send("/undo\r")
        t.wait("undid 1 exchange:")
        t.send("/help\r")
        t.wait("/persona NAME")
        t.wait(t.prompt_ready)
        from chatcli.repl.commands import REGISTRY

        for cmd in REGISTRY.commands.values():
            assert sum(ln.startswith(cmd.usage + " ") for ln in t.lines()) == 1, cmd.usage

        # Ctrl-C at the prompt clears what was typed.
        t.send("a draft I regret")
        t.wait("a draft I regret")
        t.send("\x03")
        t.wait(lambda: "Ctrl-C again to exit" in t.display()[-1])
        assert "a draft I regret" not in "\n".join(t.display())

        # Ctrl-C during a reply stops it; what was written is kept and the prompt comes back.
        time.sleep(1.1)  # not a double Ctrl-C
        t.send("Tell me a long story about a dragon.\r")
        t.wait(lambda: bool(t.reply_after("› Tell me a long story about a dragon.")), timeout=60)
        t.send("\x03")
        t.wait("stopped by Ctrl-C: partial reply kept", timeout=30)
        t.wait(t.prompt_ready)
        story = re.split(r"\n\d+ tok evaluated", t.text().split("› Tell me a long story about a dragon.", 1)[1])[0]
        assert story.strip(), "the partial reply stays on screen"
        assert "thinking" not in "\n".join(t.display())  # no spinner left behind

        # Ctrl-D leaves, saying how to come back.
        t.send("\x04")
        t.wait(f"resume with: chatcli resume {conv_id}")
        t.child.expect(pexpect.EOF, timeout=30)
        t.child.close()
        assert t.child.exitstatus == 0
    finally:
        t.close()

    # `resume` shows the history (with the partial story) and restores the state without re-reading it.
    r = Terminal(["resume"], term_env, tmp_path)
    try:
        r.wait(r.prompt_ready, timeout=60)
        text = r.text()
        assert "› Hi! What is your name?" in text
        assert "› Tell me a long story about a dragon." in text
        assert "Name one colour." not in text  # it was undone
        first_words = story.split()[:3]
        assert " ".join(first_words) in text
        assert re.search(rf"resumed {conv_id}: restored \d+ tokens .* re-evaluated 0 tokens", text)
        r.send("\x04")
        r.child.expect(pexpect.EOF, timeout=30)
    finally:
        r.close()
    assert time.monotonic() - t0 < 180  # ~30 s on an idle machine; generous for a loaded CI box
