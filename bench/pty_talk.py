"""``chatcli talk`` kept running for a whole benchmark, one message per round, in a pseudo-terminal (the
REPL, its live Markdown rendering and its toolbar, as a user runs it) or piped (one line per message).

Each round sends one message, reads the stats line's decode and prompt tok/s, then ``/undo`` takes the
exchange back out, so every round evaluates the same number of tokens at the same depth (after the
persona's prefix) and decodes from the same depth. The reader looks only at what arrived since the message
was sent and scans the screen only when a stats line can be in it: the harness shares the cores with what it
measures, and rescanning a growing screen on every frame of the reply took CPU from the decode.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from pathlib import Path

_ESCAPES = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
# The stats line: "… · ttft N ms · D tok/s · prompt P tok/s · …" (decoding first).
_STATS = re.compile(r"(?<!prompt )\b([\d.]+) tok/s.*?prompt ([\d.]+) tok/s")


def _screen_text(buf: bytes) -> str:
    return _ESCAPES.sub(b"", buf).decode(errors="replace")


class TalkSession:
    """One ``chatcli talk`` process; ``terminal``: on a ``rows``×``cols`` pty, else stdin/stdout/stderr pipes."""

    def __init__(self, argv: list[str], env: dict[str, str], *, cwd: Path, terminal: bool, rows: int = 45,
                 cols: int = 160, timeout: float = 300.0) -> None:
        self.terminal = terminal
        self.rows = rows
        self.timeout = timeout
        self.buf = b""
        if terminal:
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            self.p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                                      env={**env, "TERM": "xterm-256color"}, cwd=str(cwd), close_fds=True)
            os.close(slave)
            self.master = master
            self._read_fds = [master]
            self._ui = master  # where the screen (or stderr: notices and the stats line) comes from
        else:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      env=env, cwd=str(cwd))
            assert self.p.stdout is not None and self.p.stderr is not None
            self._read_fds = [self.p.stdout.fileno(), self.p.stderr.fileno()]
            self._ui = self.p.stderr.fileno()
        if terminal and self._wait(lambda text: "Ctrl-D exit" in text, "Ctrl-D") is None:
            raise RuntimeError("chatcli talk did not show its prompt")

    def _write(self, data: bytes) -> None:
        if self.terminal:
            os.write(self.master, data)
        else:
            assert self.p.stdin is not None
            self.p.stdin.write(data)
            self.p.stdin.flush()

    def _wait(self, found: Callable[[str], bool], marker: str) -> str | None:
        """Read until ``found`` accepts the text since the last send (looked at only when ``marker`` has
        just arrived, in the last few kB: the screen of a reply is redrawn every frame)."""
        deadline = time.monotonic() + self.timeout
        mark = marker.encode()
        while time.monotonic() < deadline and self.p.poll() is None:
            ready, _, _ = select.select(self._read_fds, [], [], 0.5)
            for fd in ready:
                try:
                    data = os.read(fd, 1 << 16)
                except OSError:
                    return None
                if fd != self._ui:
                    continue  # piped replies on stdout: read so the pipe never fills
                if self.terminal:
                    # Answer prompt_toolkit's cursor position requests as a terminal does (else it waits, then warns).
                    for _ in range(data.count(b"\x1b[6n")):
                        os.write(self.master, f"\x1b[{self.rows};1R".encode())
                tail = self.buf[-len(mark):]
                self.buf += data
                if mark in tail + data:
                    text = _screen_text(self.buf[-8192:])
                    if found(text):
                        return text
        return None

    def message(self, text: str) -> tuple[float | None, float | None]:
        """Send one message; the stats line's decode and prompt tok/s (None: not seen in time)."""
        self.buf = b""
        self._write(text.encode() + (b"\r" if self.terminal else b"\n"))
        got = self._wait(lambda t: _STATS.search(t) is not None, "tok/s")
        if got is None:
            return None, None
        decode, prompt = _STATS.findall(got)[-1]
        return float(decode), float(prompt)

    def undo(self) -> bool:
        """``/undo`` the last exchange and wait for it (in a terminal, for the prompt to be back too)."""
        self.buf = b""
        self._write(b"/undo" + (b"\r" if self.terminal else b"\n"))
        if self.terminal:
            return self._wait(lambda t: "undid" in t and t.rfind("Ctrl-D exit") > t.find("undid"), "Ctrl-D") is not None
        return self._wait(lambda t: "undid" in t, "undid") is not None

    def close(self) -> None:
        try:
            if self.terminal:
                os.write(self.master, b"\x04")
            elif self.p.stdin is not None:
                self.p.stdin.close()
            self.p.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()
        finally:
            if self.terminal:
                os.close(self.master)

