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
    gen_seconds: float = 0.0  # from asking for the first token to the reply's end
    decode_seconds: float = 0.0  # from the first token shown to the last one (``tokens_per_second``)
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
        """Decoding speed as llama-server's ``timings``, its streamed clients and the benchmarks count it, so
        that users can compare the two: the tokens after the first over the time from the first token shown
        to the last one. The first token's wait is the time to first token; after the last one nothing is
        waited for (its decode, the reply's closing and save), so neither is in it. A reply of one token
        has no such span: its one token over the generation's time."""
        return decode_rate(self.n_generated, self.decode_seconds, self.gen_seconds)


def decode_rate(n_generated: int, decode_seconds: float, gen_seconds: float) -> float:
    """``TurnStats.tokens_per_second`` of these counts."""
    if n_generated > 1 and decode_seconds > 0:
        return (n_generated - 1) / decode_seconds
    return n_generated / gen_seconds if gen_seconds > 0 else 0.0


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
    # Over the replies with two tokens or more: tokens after each one's first, and their spans.
    n_after_first: int = 0
    decode_seconds: float = 0.0

    def add(self, s: TurnStats) -> None:
        self.turns += 1
        self.n_eval += s.n_eval
        self.n_generated += s.n_generated
        self.gen_seconds += s.gen_seconds
        if s.n_generated > 1 and s.decode_seconds > 0:
            self.n_after_first += s.n_generated - 1
            self.decode_seconds += s.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """``TurnStats.tokens_per_second`` over the session's replies."""
        if self.n_after_first and self.decode_seconds > 0:
            return self.n_after_first / self.decode_seconds
        return decode_rate(self.n_generated, 0.0, self.gen_seconds)


@dataclass(frozen=True)
class ContextUsage:
    n_past: int
    n_ctx: int

    @property
    def fraction(self) -> float:
        return min(1.0, self.n_past / self.n_ctx) if self.n_ctx else 0.0


Event = Notice | Progress | ReplyStart | ReplyText | ReplyEnd
EVENT_TYPES = (Notice, Progress, ReplyStart, ReplyText, ReplyEnd)
