"""What the REPL and its slash commands may touch: a conversation's public API, the renderer, the I/O.

``ChatConversation`` is the interface a front end uses (``Conversation`` implements it through its views;
test doubles implement it too). ``CommandContext`` is all a slash command gets: not the Repl, so a command
cannot reach into the loop, the session or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, Protocol

from chatcli.core.events import ContextUsage, Event, Notice, SessionStats, TurnStats

if TYPE_CHECKING:
    from chatcli.config.personas import Persona
    from chatcli.core.transcript import ActiveMessage
    from chatcli.core.views import Alternative
    from chatcli.repl.render import Renderer


class ChatIO(Protocol):
    """The terminal or a pipe: how the REPL reads lines and edits text."""

    def read(self, default: str = "") -> str: ...
    def edit_text(self, text: str) -> str | None: ...
    def copy_to_clipboard(self, text: str) -> str: ...
    def busy(self) -> ContextManager[None]: ...


class ChatConversation(Protocol):
    """An open conversation as a front end sees it: read-only views and the operations."""

    @property
    def id(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def persona_name(self) -> str: ...
    @property
    def greeting(self) -> str | None: ...
    @property
    def system_prompt(self) -> str | None: ...
    @property
    def messages(self) -> list[ActiveMessage]: ...
    @property
    def n_turns(self) -> int:
        """Exchanges still in the model's context."""
        ...

    @property
    def n_exchanges(self) -> int:
        """Exchanges of the whole conversation, also those that left the context."""
        ...

    @property
    def pending_user(self) -> bool: ...
    @property
    def context(self) -> ContextUsage: ...
    @property
    def last_stats(self) -> TurnStats | None: ...
    @property
    def session_stats(self) -> SessionStats: ...
    @property
    def save_error(self) -> str: ...

    def user_messages(self) -> list[ActiveMessage]: ...
    def alternatives(self) -> list[Alternative]: ...
    def state_bytes(self) -> int: ...
    def holds_context(self) -> bool: ...
    def to_markdown(self) -> str: ...
    def take_notices(self) -> list[Notice]:
        """Notices raised outside a reply (a failed save after /undo): shown once, after the command."""
        ...

    def send(self, text: str, *, seed: int | None = None) -> Iterator[Event]: ...
    def regen(self, *, seed: int | None = None) -> Iterator[Event]: ...
    def edit(self, n: int | None, text: str, *, seed: int | None = None) -> Iterator[Event]: ...
    def undo(self, n: int = 1) -> TurnStats: ...
    def redo(self) -> TurnStats: ...
    def switch_alt(self, index: int) -> TurnStats: ...
    def set_title(self, title: str) -> None: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class CommandContext:
    """What one slash command runs with (made afresh for each command: /persona changes the conversation)."""

    conv: ChatConversation
    renderer: Renderer
    io: ChatIO
    run_reply: Callable[[Iterator[Event]], None]  # render a streamed reply; Ctrl-C stops it
    personas: Callable[[], Mapping[str, Persona]]
    switch_persona: Callable[[str], None]  # start a new conversation; this one is saved and closed
    search: Callable[[str], list[str]] = lambda text: []  # the lines `chatcli search TEXT` would print

    def show_last(self) -> None:
        """Print the last reply again (after /redo or /alt changed it)."""
        msgs = self.conv.messages
        if msgs and msgs[-1].role == "assistant":
            if msgs[-1].reasoning:
                self.renderer.reasoning(msgs[-1].reasoning, msgs[-1].reasoning_tokens,
                                        full=self.renderer.show_reasoning)
            self.renderer.reply_text(msgs[-1].shown)


__all__ = ["ChatConversation", "ChatIO", "CommandContext"]
