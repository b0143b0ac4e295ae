"""The chat loop: read → dispatch → render.

Terminal I/O is injected (``TerminalIO`` for a TTY, ``LineIO`` for pipes and tests), so the same loop
runs under prompt_toolkit, in a pipeline and in unit tests.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import HTML
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.output import Output

from chatcli.core.conversation import Conversation
from chatcli.core.events import Event, Progress, ResumeReport
from chatcli.core.files.fsutil import ensure_private_dir
from chatcli.core.opening import Opening
from chatcli.core.search import hit_lines, run_search
from chatcli.errors import ChatcliError
from chatcli.repl.commands import REGISTRY, CommandError, ReplExit, UnknownCommand, dispatch
from chatcli.repl.context import ChatConversation, ChatIO, CommandContext
from chatcli.repl.render import Renderer
from chatcli.units import format_size

if TYPE_CHECKING:
    from chatcli.session import Session

# Every chatcli error is shown as one line and the loop goes on; so is a file the OS refused (e.g. /export).
USER_ERRORS = (ChatcliError, OSError)


class ReadingStopped(Exception):
    """Ctrl-C while a long message was being read: it was taken back out and returns to the prompt."""


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


class Repl:
    """The chat loop around one open conversation."""

    def __init__(
        self,
        session: Session,
        conv: ChatConversation,
        renderer: Renderer,
        io_factory: Callable[[Repl], ChatIO],
    ) -> None:
        self.session = session
        self.conv = conv
        self.renderer = renderer
        self.hint = ""
        self.io: ChatIO = io_factory(self)
        self._exit_requested = False
        self._generating = False
        self._cancel_requested = False
        self.failures = 0  # messages and commands refused or failed: a piped session's exit status says so

    # -- toolbar ---------------------------------------------------------------------------------

    def set_hint(self, text: str) -> None:
        """A transient message in the toolbar (e.g. "Ctrl-C again to exit")."""
        self.hint = text

    def toolbar_parts(self) -> list[tuple[int, str, str]]:
        """The toolbar's pieces as (priority, plain text, markup); lower priorities go first when narrow."""
        conv = self.conv
        use = conv.context
        frac = use.fraction
        bar = context_bar(frac)
        s = self.session
        # A llama-server session has no local model file: its name comes from the server.
        model = "?" if s is None else s.model.info.name if s.model is not None else s.model_name
        if len(model) > 24:
            model = model[:23] + "…"
        persona = conv.persona_name
        ctx = f"ctx {use.n_past}/{use.n_ctx} {bar}"
        ctx_markup = f"ctx {use.n_past}/{use.n_ctx} {esc(bar)}"
        if frac >= 0.9:
            ctx_markup = f"<b>{ctx_markup}</b>"
        state = f"state {format_size(conv.state_bytes())}"
        keys = self.hint or "/help · Ctrl-D exit"
        keys_markup = f"<b>{esc(self.hint)}</b>" if self.hint else esc(keys)
        # In display order; the priorities decide what stays when the terminal is narrow.
        return [
            (9, persona, f"<b>{esc(persona)}</b>"),
            (5, model, esc(model)),
            (6, conv.id, esc(conv.id)),
            (8, ctx, ctx_markup),
            (3, state, esc(state)),
            (7 if self.hint else 4, keys, keys_markup),
        ]

    def toolbar(self, width: int | None = None) -> HTML:
        if width is None:
            width = _terminal_columns()
        parts = self.toolbar_parts()
        sep = " · "
        shown = list(parts)
        # Drop the least important pieces until the line fits (narrow terminals).
        while len(shown) > 1 and 1 + sum(len(p[1]) for p in shown) + len(sep) * (len(shown) - 1) > width:
            shown.remove(min(shown, key=lambda p: p[0]))
        return HTML(" " + sep.join(p[2] for p in shown))

    # -- loop ------------------------------------------------------------------------------------------

    def run(self) -> int:
        pending = ""
        old_term = signal.signal(signal.SIGTERM, self._on_term)
        old_hup = signal.signal(signal.SIGHUP, self._on_term) if hasattr(signal, "SIGHUP") else None
        try:
            if self.conv.pending_user:
                self.renderer.notice("the last message has no reply (the session ended mid-reply): generating it now")
                with self._busy():
                    self.run_reply(self.conv.regen())
            while not self._exit_requested:
                try:
                    line = self.io.read(default=pending)
                except EOFError:
                    break
                except KeyboardInterrupt:
                    pending = ""
                    continue
                finally:
                    self.hint = ""
                pending = ""
                if not line.strip():
                    continue
                try:
                    with self._busy():
                        if line.startswith("/") and not line.startswith("//"):
                            try:
                                dispatch(self.command_context(), line.strip())
                            except UnknownCommand:
                                pending = line  # a typo, or a message meant to start with "/": keep it
                                raise
                        else:
                            text = line[1:] if line.startswith("//") else line
                            n_users = len(self.conv.user_messages())
                            try:
                                self.run_reply(self.conv.send(text), stop_reading=True)
                            except ReadingStopped:
                                pending = line
                                self.renderer.notice("Ctrl-C: stopped reading your message; it is back at the "
                                                     "prompt (Enter sends it again)")
                            except USER_ERRORS:
                                if len(self.conv.user_messages()) == n_users:
                                    pending = line  # refused, so it comes back in the prompt: nothing is lost
                                raise
                    for notice in self.conv.take_notices():  # e.g. the state budget after /undo or /alt
                        self.renderer.notice(notice.text, notice.level)
                except ReplExit:
                    break
                except BrokenPipeError:
                    # Whoever read our output is gone (`chatcli talk | head`): end quietly; what is saved stays.
                    self._quiet_exit = True
                    break
                except USER_ERRORS as exc:
                    self.failures += 1
                    self.renderer.error(_one_line(exc))
                except UnicodeError as exc:
                    self.failures += 1
                    self.renderer.error(f"input is not valid text: {exc}")
        finally:
            signal.signal(signal.SIGTERM, old_term)
            if old_hup is not None:
                signal.signal(signal.SIGHUP, old_hup)
            self.conv.close()
            if not getattr(self, "_quiet_exit", False):
                self.renderer.notice(f"conversation {self.conv.id} saved · resume with: chatcli resume {self.conv.id}")
        return 0

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Around one command or message. Ctrl-C stops a streaming reply; any other operation (an undo,
        a persona switch) is short and runs to its end, so the context and the files stay consistent."""
        interrupted = [False]

        def on_int(signum: int, frame: Any) -> None:
            if self._generating:
                self._cancel_requested = True
                self.conv.cancel()
            else:
                interrupted[0] = True

        try:
            old = signal.signal(signal.SIGINT, on_int)
        except ValueError:  # not the main thread (embedded use): leave signals alone
            old = None
        try:
            with self.io.busy():
                yield
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
            if interrupted[0]:
                self.renderer.notice("Ctrl-C: that operation cannot stop halfway; it has finished")

    def _on_term(self, signum: int, frame: Any) -> None:
        # State is saved after every turn; a running reply is stopped and kept, then the loop ends.
        self._exit_requested = True
        if self._generating:
            self.conv.cancel()
        else:
            raise EOFError

    def run_reply(self, events: Iterator[Event], *, stop_reading: bool = False) -> None:
        """Render an operation that streams a reply; Ctrl-C stops the reply, not the program. With
        ``stop_reading`` (a new message, which the caller can give back), a Ctrl-C while the message is
        still being read stops that between two batches: ReadingStopped, the message out of the context."""
        self._generating = True
        self._cancel_requested = False
        try:
            end = self.renderer.stream(self._cancellable(events, stop_reading), label="thinking")
        finally:
            self._generating = False
            close = getattr(events, "close", None)
            if close is not None:
                close()  # if rendering failed mid-reply, the conversation records what was produced, now
        if end is not None:
            self.renderer.stats(end.stats)

    def _cancellable(self, events: Iterator[Event], stop_reading: bool = False) -> Iterator[Event]:
        # A Ctrl-C that lands before sampling starts (while the message is read) would be forgotten when
        # generation begins, so the request is repeated until the reply ends.
        for ev in events:
            if self._cancel_requested:
                if stop_reading and isinstance(ev, Progress) and ev.stoppable:
                    # A long message (a paste) reads for seconds to minutes: do not make Ctrl-C wait for it.
                    # run_reply closes ``events`` on the way out, which takes the message back out.
                    raise ReadingStopped
                self.conv.cancel()
            yield ev

    def command_context(self) -> CommandContext:
        """What a slash command may use (made per command: /persona replaces the conversation)."""
        return CommandContext(conv=self.conv, renderer=self.renderer, io=self.io, run_reply=self.run_reply,
                              personas=self.session.personas, switch_persona=self.switch_persona,
                              search=self.search)

    def search(self, text: str) -> list[str]:
        """`/search TEXT`: the hits as `chatcli search` prints them (snippets without terminal codes)."""
        hits, notices = run_search(text, self.session.store, limit=10)
        return [*notices, *hit_lines(hits, bold=False)]

    def switch_persona(self, name: str) -> None:
        """Start a new conversation from persona ``name``; the current one is saved and closed."""
        old = self.conv
        try:
            conv, _ = open_events(self.session.new_conversation(name), self.renderer)
        except BaseException:
            # Creating the new conversation may have cleared the shared context: bring the old one back.
            if not old.holds_context():
                old.close()
                self.conv, _ = open_events(self.session.open_conversation(old.id), self.renderer)
            raise
        old.close()
        self.conv = conv
        self.renderer.notice(f"conversation {old.id} saved (chatcli resume {old.id}); "
                             f"new conversation {conv.id} with persona {conv.persona_name or name}")
        if conv.greeting:
            self.renderer.reply_text(conv.greeting)


def context_bar(frac: float, width: int = 10) -> str:
    """A bar of ``width`` cells, in eighths, showing how full the context is."""
    eighths = round(max(0.0, min(1.0, frac)) * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    return bar + "░" * (width - len(bar))


def esc(text: object) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _terminal_columns() -> int:
    try:
        from prompt_toolkit.application.current import get_app

        return get_app().output.get_size().columns
    except Exception:
        return shutil.get_terminal_size().columns


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return text.splitlines()[0]


def open_events(opening: Opening[Conversation], renderer: Renderer) -> tuple[Conversation, ResumeReport | None]:
    """Render an opening's events; return its conversation (and resume report)."""
    renderer.stream(opening, label="loading")
    return opening.conversation, opening.report


def is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


