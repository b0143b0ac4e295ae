"""The chat loop: read → dispatch → render.

Terminal I/O is injected (``TerminalIO`` for a TTY, ``LineIO`` for pipes and tests), so the same loop
runs under prompt_toolkit, in a pipeline and in unit tests.
"""

from __future__ import annotations

import base64
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import HTML
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.output import Output

from chatcli.commands import REGISTRY, CommandError, ReplExit, dispatch
from chatcli.conversation import Conversation, ConversationError, Event, ResumeReport
from chatcli.engine import ContextFullError, EngineError
from chatcli.personas import PersonaError
from chatcli.render import Renderer, human_bytes
from chatcli.template import TemplateError

USER_ERRORS = (CommandError, ConversationError, ContextFullError, PersonaError, TemplateError, EngineError, OSError)


class ChatIO(Protocol):
    def read(self, default: str = "") -> str: ...
    def edit_text(self, text: str) -> str | None: ...
    def copy_to_clipboard(self, text: str) -> str: ...


class SlashCompleter(Completer):
    """Completes command names, then each command's arguments (persona names, alternative numbers)."""

    def __init__(self, repl: Repl) -> None:
        self.repl = repl

    def get_completions(self, document: Document, complete_event: Any) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/") or "\n" in text:
            return
        if " " not in text:
            for name in REGISTRY.names():
                if name.startswith(text[1:]):
                    cmd = REGISTRY.lookup(name)
                    yield Completion("/" + name, start_position=-len(text), display_meta=cmd.help if cmd else "")
            return
        word, _, arg = text[1:].partition(" ")
        cmd = REGISTRY.lookup(word)
        if cmd is None or cmd.complete is None:
            return
        try:
            options = cmd.complete(self.repl)
        except Exception:
            return
        for opt in options:
            if opt.startswith(arg):
                yield Completion(opt, start_position=-len(arg))


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
        from chatcli.keys import chat_key_bindings

        history = InMemoryHistory()
        if history_file is not None:
            try:
                history_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                history = FileHistory(str(history_file))
            except OSError:
                pass
        self.repl = repl
        self.session: PromptSession[str] = PromptSession(
            history=history, completer=SlashCompleter(repl), complete_while_typing=True,
            key_bindings=chat_key_bindings(), multiline=True, bottom_toolbar=repl.toolbar,
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


def copy_to_clipboard(text: str, terminal: TextIO | None) -> str:
    for cmd in (["wl-copy"], ["xclip", "-selection", "clipboard"], ["xsel", "-b", "-i"], ["pbcopy"]):
        if shutil.which(cmd[0]):
            try:
                subprocess.run(cmd, input=text.encode(), check=True, timeout=5)
                return cmd[0]
            except (OSError, subprocess.SubprocessError):
                continue
    if terminal is not None:
        # OSC 52: the terminal itself sets the clipboard (works over SSH in most modern terminals).
        terminal.write("\x1b]52;c;" + base64.b64encode(text.encode()).decode() + "\x07")
        terminal.flush()
        return "OSC 52"
    raise CommandError("no clipboard available")


class Repl:
    """The chat loop around one open conversation."""

    def __init__(
        self,
        session: Any,
        conv: Conversation,
        renderer: Renderer,
        io_factory: Callable[[Repl], ChatIO],
    ) -> None:
        self.session = session
        self.conv = conv
        self.renderer = renderer
        self.io: ChatIO = io_factory(self)
        self._exit_requested = False
        self._generating = False

    # -- toolbar ---------------------------------------------------------------------------------

    def toolbar(self) -> HTML:
        conv = self.conv
        eng = conv.engine
        frac = eng.n_past / eng.n_ctx if eng.n_ctx else 0.0
        filled = int(round(frac * 10))
        bar = "█" * filled + "░" * (10 - filled)
        model = self.session.model.info.name if self.session is not None else "?"
        esc = lambda s: str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")  # noqa: E731
        return HTML(
            f" <b>{esc(conv.meta.get('persona', ''))}</b> · {esc(model)} · {esc(conv.id)} · "
            f"ctx {eng.n_past}/{eng.n_ctx} {bar} · state {human_bytes(conv.state_bytes())} · "
            "Alt-Enter newline · Alt-←/→ alts · /help"
        )

    # -- loop ------------------------------------------------------------------------------------------

    def run(self) -> int:
        pending = ""
        old_term = signal.signal(signal.SIGTERM, self._on_term)
        old_hup = signal.signal(signal.SIGHUP, self._on_term) if hasattr(signal, "SIGHUP") else None
        try:
            if self.conv.pending_user:
                self.renderer.notice("the last message has no reply (the session ended mid-reply): generating it now")
                self.run_reply(self.conv.regen())
            while not self._exit_requested:
                try:
                    line = self.io.read(default=pending)
                except EOFError:
                    break
                except KeyboardInterrupt:
                    pending = ""
                    continue
                pending = ""
                if not line.strip():
                    continue
                try:
                    if line.startswith("/") and not line.startswith("//"):
                        dispatch(self, line.strip())
                    else:
                        text = line[1:] if line.startswith("//") else line
                        try:
                            self.run_reply(self.conv.send(text))
                        except USER_ERRORS:
                            pending = line  # nothing the user wrote is lost: it comes back in the prompt
                            raise
                except ReplExit:
                    break
                except USER_ERRORS as exc:
                    self.renderer.error(_one_line(exc))
                except UnicodeError as exc:
                    self.renderer.error(f"input is not valid text: {exc}")
        finally:
            signal.signal(signal.SIGTERM, old_term)
            if old_hup is not None:
                signal.signal(signal.SIGHUP, old_hup)
            self.conv.close()
            self.renderer.notice(f"conversation {self.conv.id} saved · resume with: chatcli resume {self.conv.id}")
        return 0

    def _on_term(self, signum: int, frame: Any) -> None:
        # State is saved after every turn; a running reply is stopped and kept, then the loop ends.
        self._exit_requested = True
        if self._generating:
            self.conv.cancel()
        else:
            raise EOFError

    def run_reply(self, events: Iterator[Event]) -> None:
        """Render an operation that streams a reply; Ctrl-C stops the reply, not the program."""
        self._generating = True
        old = signal.signal(signal.SIGINT, lambda s, f: self.conv.cancel())
        try:
            end = self.renderer.stream(events)
        finally:
            signal.signal(signal.SIGINT, old)
            self._generating = False
        if end is not None:
            self.renderer.stats(end.stats)
        if self.conv.save_error:
            self.renderer.notice(self.conv.save_error, "warn")

    def show_last(self) -> None:
        msgs = self.conv.messages
        if msgs and msgs[-1].role == "assistant":
            self.renderer.reply_text(msgs[-1].text)

    def switch_persona(self, name: str) -> None:
        conv, _ = open_events(self.session.new_conversation(name), self.renderer)
        old = self.conv
        old.close()
        self.conv = conv
        self.renderer.notice(f"conversation {old.id} saved; new conversation {conv.id} with persona {name}")


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return text.splitlines()[0]


def open_events(events: Iterable[Event | ResumeReport | Conversation], renderer: Renderer) -> tuple[Conversation, ResumeReport | None]:
    """Drain a create/open generator: render its events, return the conversation (and resume report)."""
    box: dict[str, Any] = {}

    def only_events() -> Iterator[Event]:
        for ev in events:
            if isinstance(ev, Conversation):
                box["conv"] = ev
            elif isinstance(ev, ResumeReport):
                box["report"] = ev
            else:
                yield ev

    renderer.stream(only_events())
    return box["conv"], box.get("report")


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


