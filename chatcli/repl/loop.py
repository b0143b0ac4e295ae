"""The chat loop: read → dispatch → render.

Terminal I/O is injected (``repl.terminal``: ``TerminalIO`` for a TTY, ``LineIO`` for pipes and tests), so
the same loop runs under prompt_toolkit, in a pipeline and in unit tests; the toolbar it shows is
``repl.toolbar``'s.
"""

from __future__ import annotations

import contextlib
import signal
from typing import TYPE_CHECKING, Any, Callable, Iterator

from prompt_toolkit.formatted_text import HTML

from chatcli.core.conversation import Conversation
from chatcli.core.events import Event, Progress, ResumeReport
from chatcli.core.opening import Opening
from chatcli.core.search import hit_lines, run_search
from chatcli.errors import ChatcliError
from chatcli.repl.commands import ReplExit, UnknownCommand, dispatch
from chatcli.repl.context import ChatConversation, ChatIO, CommandContext
from chatcli.repl.render import Renderer
from chatcli.repl.toolbar import toolbar_line, toolbar_parts

if TYPE_CHECKING:
    from chatcli.session import Session

# Every chatcli error is shown as one line and the loop goes on; so is a file the OS refused (e.g. /export).
USER_ERRORS = (ChatcliError, OSError)


class ReadingStopped(Exception):
    """Ctrl-C while a long message was being read: it was taken back out and returns to the prompt."""


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

    def toolbar(self, width: int | None = None) -> HTML:
        """The bottom toolbar, fitted to ``width`` columns (default: the terminal's)."""
        return toolbar_line(toolbar_parts(self.conv, self.session, self.hint), width)

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
        its rebuild included, a persona switch) runs to its end, so the context and the files stay consistent."""
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


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return text.splitlines()[0]


def open_events(opening: Opening[Conversation], renderer: Renderer) -> tuple[Conversation, ResumeReport | None]:
    """Render an opening's events; return its conversation (and resume report)."""
    renderer.stream(opening, label="loading")
    return opening.conversation, opening.report
