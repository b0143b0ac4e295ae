"""The REPL's terminal and pipe I/O: the prompt_toolkit prompt (history, completion, no echo while a reply
streams), one message per line for pipes, and the clipboard.

Both implement ``repl.context.ChatIO``; the loop (``repl/loop.py``) is given one and never knows which.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ContextManager, Iterable, Iterator, TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import HTML
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.output import Output

from chatcli.core.files.fsutil import ensure_private_dir
from chatcli.repl.commands import REGISTRY, CommandError

if TYPE_CHECKING:
    from chatcli.repl.loop import Repl


class SlashCompleter(Completer):
    """Completes command names, then each command's arguments (persona names, alternative numbers)."""

    def __init__(self, repl: Repl) -> None:
        self.repl = repl

    def get_completions(self, document: Document, complete_event: Any) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/") or text.startswith("//") or "\n" in text:
            return
        if " " not in text:
            for name in REGISTRY.names():
                if name.startswith(text[1:].lower()):
                    cmd = REGISTRY.lookup(name)
                    yield Completion("/" + name, start_position=-len(text), display_meta=cmd.help if cmd else "")
            return
        word, _, arg = text[1:].partition(" ")
        cmd = REGISTRY.lookup(word.lower())
        if cmd is None or cmd.complete is None:
            return
        try:
            options = cmd.complete(self.repl.command_context())
        except Exception:  # completion must never break typing
            return
        for opt in options:
            value, meta = opt if isinstance(opt, tuple) else (opt, "")
            if value.startswith(arg):
                yield Completion(value, start_position=-len(arg), display_meta=meta)


class TerminalIO:
    """prompt_toolkit prompt with history, completion, multi-line input and a bottom toolbar."""

    def __init__(
        self,
        repl: Repl,
        *,
        history_file: Path | None = None,
        input: Input | None = None,
        output: Output | None = None,
    ) -> None:
        from chatcli.repl.keys import chat_key_bindings

        history: History = InMemoryHistory()
        if history_file is not None:
            try:
                ensure_private_dir(history_file.parent)
                # Everything the user typed is in there: private from the start (FileHistory would
                # create it with the umask's 0644), and made private if an older version left it open.
                os.close(os.open(history_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
                if history_file.stat().st_mode & 0o077:
                    os.chmod(history_file, 0o600)
                history = FileHistory(str(history_file))
            except OSError:
                pass
        self.repl = repl
        # The real terminal's fd when we own it (not in tests): typing during a reply must not echo.
        self._tty_fd = sys.stdin.fileno() if input is None and is_tty(sys.stdin) else None
        self.session: PromptSession[str] = PromptSession(
            history=history, completer=SlashCompleter(repl), complete_while_typing=True,
            key_bindings=chat_key_bindings(repl.set_hint), multiline=True, bottom_toolbar=repl.toolbar,
            input=input, output=output, prompt_continuation=lambda width, n, soft: "… ".rjust(width),
        )

    def read(self, default: str = "") -> str:
        return self.session.prompt(HTML("<b>› </b>"), default=default)

    def edit_text(self, text: str) -> str | None:
        try:
            return self.session.prompt(HTML("<b>edit › </b>"), default=text)
        except (EOFError, KeyboardInterrupt):
            return None

    def copy_to_clipboard(self, text: str) -> str:
        return copy_to_clipboard(text, self.repl.renderer.console.file)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """While a reply streams: keys typed are not echoed (they would break the live display) but are
        kept for the next prompt; Ctrl-C still raises SIGINT, which stops the reply."""
        fd = self._tty_fd
        if fd is None:
            yield
            return
        try:
            import termios  # POSIX only: elsewhere typing during a reply simply echoes
        except ImportError:
            yield
            return
        try:
            old = termios.tcgetattr(fd)
        except (termios.error, OSError):
            yield
            return
        new = list(old)
        new[3] = new[3] & ~(termios.ECHO | termios.ICANON)
        new[6] = list(old[6])
        new[6][termios.VMIN] = 1
        new[6][termios.VTIME] = 0
        try:
            termios.tcsetattr(fd, termios.TCSANOW, new)
            yield
        finally:
            with contextlib.suppress(termios.error, OSError):
                termios.tcsetattr(fd, termios.TCSANOW, old)


class LineIO:
    """One line of a stream is one message (pipes, scripts, tests)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def read(self, default: str = "") -> str:
        line = self.stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def edit_text(self, text: str) -> str | None:
        # In a pipe the replacement text is simply the next line.
        try:
            return self.read()
        except EOFError:
            return None

    def copy_to_clipboard(self, text: str) -> str:
        return copy_to_clipboard(text, None)

    def busy(self) -> ContextManager[None]:
        return contextlib.nullcontext()


def copy_to_clipboard(text: str, terminal: IO[str] | None) -> str:
    """Copy with the desktop's clipboard tool, else through the terminal (OSC 52); returns how."""
    tools = []
    if os.environ.get("WAYLAND_DISPLAY"):
        tools.append(["wl-copy"])
    if os.environ.get("DISPLAY"):
        tools += [["xclip", "-selection", "clipboard"], ["xsel", "-b", "-i"]]
    if sys.platform == "darwin":
        tools.append(["pbcopy"])
    for cmd in tools:
        if shutil.which(cmd[0]):
            try:
                subprocess.run(cmd, input=text.encode(), check=True, timeout=5,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                return cmd[0]
            except (OSError, subprocess.SubprocessError):
                continue
    if terminal is not None and is_tty(terminal):
        # OSC 52: the terminal itself sets the clipboard (works over SSH and in tmux in most terminals).
        terminal.write("\x1b]52;c;" + base64.b64encode(text.encode()).decode() + "\x07")
        terminal.flush()
        return "OSC 52"
    raise CommandError("no clipboard available (no wl-copy, xclip, xsel or pbcopy, and output is not a terminal)")


def is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
