"""What conversation operations report while they run, and the error they refuse with.

Operations are generators of these events; front ends (REPL, CLI, server) render them. This module is a
leaf: it imports nothing from chatcli at run time, so any front end may import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chatcli.errors import ChatcliError, DoesNotFitError, Kind

if TYPE_CHECKING:
    from chatcli.core.transcript import ActiveMessage


class ConversationError(ChatcliError, ValueError):
    """A request the conversation cannot honour (one line for the user); nothing was changed."""

    kind: Kind = "refused"


class MessageTooLongError(ConversationError, DoesNotFitError):
    """The conversation's policy refuses a message or history that cannot fit even after a context shift."""


@dataclass
class Notice:
    text: str
    level: str = "info"  # info | warn | error


@dataclass
class Progress:
    label: str
    done: int
    total: int
    seconds: float = 0.0
    # Closing the operation's generator right after this event is safe and cheap: what was being
    # evaluated (a new message) is taken back out and nothing else changes. Front ends stop there on
    # Ctrl-C or a client that went away; elsewhere (rebuilding a context) they must let it finish.
    stoppable: bool = False


@dataclass
class ReplyStart:
    turn: int
    alt: int


@dataclass
class ReplyText:
    text: str
    reasoning: bool = False  # part of the reply's reasoning (shown apart from the answer)


@dataclass
class TurnStats:
    n_eval: int = 0  # tokens evaluated for this turn (new user tokens + decoded reply tokens + closing)
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    ttft: float = 0.0
    n_generated: int = 0
    gen_seconds: float = 0.0
    stop_reason: str = ""
    n_past: int = 0
    n_ctx: int = 0
    state_bytes: int = 0
    save_ms: float = 0.0
    kept: int | None = None  # rollbacks: tokens kept / dropped / re-evaluated
    dropped: int | None = None
    reevaluated: int | None = None
    notices: list[Notice] = field(default_factory=list)  # what went wrong saving (rollbacks that return stats)
    # What an engine that evaluates lazily (a llama-server) reported for this reply's prompt: tokens it
    # evaluated and tokens it found already in its cache. None for the local engine.
    server_evaluated: int | None = None
    server_cached: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.n_generated / self.gen_seconds if self.gen_seconds > 0 else 0.0


@dataclass
class ReplyEnd:
    message: ActiveMessage
    stats: TurnStats


@dataclass
class ResumeReport:
    restored_tokens: int = 0
    restored_bytes: int = 0
    seconds: float = 0.0
    reevaluated: int = 0
    reason: str = ""  # why the saved state was not (fully) used


@dataclass
class SessionStats:
    """Totals over the replies of one open conversation (this process)."""

    turns: int = 0
    n_eval: int = 0
    n_generated: int = 0
    gen_seconds: float = 0.0

    def add(self, s: TurnStats) -> None:
        self.turns += 1
        self.n_eval += s.n_eval
        self.n_generated += s.n_generated
        self.gen_seconds += s.gen_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.n_generated / self.gen_seconds if self.gen_seconds > 0 else 0.0


@dataclass(frozen=True)
class ContextUsage:
    n_past: int
    n_ctx: int

    @property
    def fraction(self) -> float:
        return min(1.0, self.n_past / self.n_ctx) if self.n_ctx else 0.0


Event = Notice | Progress | ReplyStart | ReplyText | ReplyEnd
EVENT_TYPES = (Notice, Progress, ReplyStart, ReplyText, ReplyEnd)
