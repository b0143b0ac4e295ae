"""``chatcli talk`` in a pseudo-terminal, as a user runs it: the REPL, its live Markdown rendering and its
toolbar, not the plain pipe mode. One message, the stats line's tok/s read off the screen.

The rendering runs between decodes, so this is the row where its cost shows (bench/decode.py section 1).
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
from pathlib import Path

_ESCAPES = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _screen_text(buf: bytes) -> str:
    return _ESCAPES.sub(b"", buf).decode(errors="replace")


def talk_in_terminal(argv: list[str], env: dict[str, str], message: str, *, cwd: Path, rows: int = 45,
                     cols: int = 160, timeout: float = 300.0) -> tuple[float | None, float | None]:
    """Start ``argv`` (a ``chatcli talk`` command line) on a ``rows``×``cols`` terminal, send ``message``,
    wait for the reply's stats line, exit with Ctrl-D; its decode and prompt tok/s (None: not seen in time)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env={**env, "TERM": "xterm-256color"},
                         cwd=str(cwd), close_fds=True)
    os.close(slave)
    buf = b""

    def wait_for(pattern: str) -> list[str] | None:
        nonlocal buf
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and p.poll() is None:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:
                    return None
                # Answer prompt_toolkit's cursor position requests as a terminal does (else it waits, then warns).
                for _ in range(data.count(b"\x1b[6n")):
                    os.write(master, f"\x1b[{rows};1R".encode())
                buf += data
            found = re.findall(pattern, _screen_text(buf))
            if found:
                return found
        return None

    try:
        if wait_for(r"Ctrl-D exit") is None:  # the toolbar: the prompt is ready
            return None, None
        buf = b""
        os.write(master, message.encode() + b"\r")
        # The stats line: "… · ttft N ms · D tok/s · … · prompt P tok/s · …" (decoding first).
        got = wait_for(r"(?<!prompt )\b([\d.]+) tok/s.*?prompt ([\d.]+) tok/s")
        os.write(master, b"\x04")
        if not got:
            return None, None
        decode, prompt = got[-1]
        return float(decode), float(prompt)
    finally:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        os.close(master)
