"""Read-only views of an open conversation: what front ends may look at (never its internals).

``Conversation`` inherits these; a front end's test double implements the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatcli.core.events import ContextUsage, SessionStats, TurnStats
from chatcli.core.export import exchange_counts, to_markdown
from chatcli.core.template import Message
from chatcli.core.transcript import ActiveMessage, Replay, Transcript, message_parts

if TYPE_CHECKING:
    from chatcli.core.backend import Backend, Logits
    from chatcli.core.files.store import ConversationDir
    from chatcli.core.kv.log import StateLog


@dataclass(frozen=True)
class Alternative:
    """One of the replies to the last user message (``/alt``)."""

    index: int  # 0-based, in the order they were generated
    mid: int
    text: str
    n_tokens: int
    active: bool


class ConversationViews:
    backend: Backend
    dir: ConversationDir
    meta: dict[str, Any]
    transcript: Transcript
    log: StateLog
    last_stats: TurnStats | None
    session_stats: SessionStats
    _meta_error: str
    _closing_due: list[int]  # a reply's end (last token, closing) not decoded yet (``Conversation._reply``)

    @property
    def id(self) -> str:
        return self.dir.id

    # ``r`` and ``engine`` are for tests and benchmarks that check internals; front ends use the views
    # (tests/test_server_boundary.py holds the server to that).
    @property
    def r(self) -> Replay:
        return self.transcript.r

    @property
    def engine(self) -> Backend:
        return self.backend

    @property
    def seed(self) -> int:
        return int(self.meta["seed"])

    @property
    def title(self) -> str:
        return str(self.meta.get("title") or "")

    @property
    def persona_name(self) -> str:
        return str(self.meta.get("persona", "") or self.r.persona)

    @property
    def persona_messages(self) -> list[Message]:
        """The messages of the persona prefix (system prompt, greeting), as the template rendered them."""
        return list(self.r.persona_messages)

    @property
    def n_prefix_tokens(self) -> int:
        """Tokens of the persona prefix: where the first message starts."""
        return len(self.r.prefix_tokens)

    @property
    def out_of_context(self) -> list[Message]:
        """The messages a context shift dropped, oldest first, as a client that kept them resends them
        (a reply by its answer): still part of the history, no longer in the context."""
        return shifted_out(self.r)

    @property
    def greeting(self) -> str | None:
        """The persona's own opening reply, if it has one."""
        said = [m.content for m in self.r.persona_messages if m.role == "assistant"]
        return said[-1] if said else None

    @property
    def system_prompt(self) -> str | None:
        said = [m.content for m in self.r.persona_messages if m.role == "system"]
        return said[0] if said else None

    @property
    def messages(self) -> list[ActiveMessage]:
        return list(self.r.active)

    def history(self) -> list[Message]:
        return [*self.r.persona_messages, *(m.as_message() for m in self.r.active)]

    def user_messages(self) -> list[ActiveMessage]:
        return [m for m in self.r.active if m.role == "user"]

    @property
    def n_turns(self) -> int:
        return sum(1 for m in self.r.active if m.role == "user")

    @property
    def n_exchanges(self) -> int:
        """Exchanges of the whole conversation, also those that left the context (``n_turns``: in it)."""
        return exchange_counts(self.r)[0]

    @property
    def pending_user(self) -> bool:
        """The last message is a user message without a reply (the process died mid-reply)."""
        return bool(self.r.active) and self.r.active[-1].role == "user"

    def alternatives(self) -> list[Alternative]:
        """The replies to the last user message, oldest first (empty when the last message is not a reply)."""
        last = self.r.active[-1] if self.r.active else None
        if last is None or last.role != "assistant":
            return []
        alts = sorted(self.r.alternatives(last.turn), key=lambda e: int(e.get("alt", 0)))
        return [Alternative(i, int(e["mid"]), _answer(e), len(e.get("tokens", [])),
                            int(e["mid"]) == last.mid) for i, e in enumerate(alts)]

    @property
    def context(self) -> ContextUsage:
        return ContextUsage(self.backend.n_past + len(self._closing_due), self.backend.n_ctx)

    def holds_context(self) -> bool:
        """The backend's sequence is this conversation's (another one may have been loaded since)."""
        return [*self.backend.tokens, *self._closing_due] == self.r.tokens()

    def state_bytes(self) -> int:
        return self.log.size_bytes()

    @property
    def turn_logits(self) -> tuple[int, Logits] | None:
        """The saved logits after the last user message (when the backend has logits)."""
        return self.log.turn_logits

    @property
    def save_error(self) -> str:
        return self.log.save_error or self._meta_error

    def to_markdown(self) -> str:
        return to_markdown(self.meta, self.r)


def shifted_out(r: Replay) -> list[Message]:
    """``ConversationViews.out_of_context`` of a replayed transcript (one read from its files)."""
    return [Message(str(e["role"]), _answer(e)) for mid in r.out_of_context if (e := r.all.get(mid)) is not None]


def _answer(ev: dict[str, Any]) -> str:
    """A reply event's text as shown: its answer, the reasoning apart."""
    answer = message_parts(ev)[1]
    return str(ev.get("text", "")) if answer is None else answer
