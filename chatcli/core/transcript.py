"""The transcript model: a conversation's events folded into its current state.

The transcript file (JSON Lines, fsynced; ``store.ConversationDir``) is the truth about a conversation.
``Replay`` folds its events into what is in the context now (the active messages), every message ever
written (alternatives, undone ones) and the redo stack. ``Transcript.append`` is the only way a live
conversation changes: the event is made durable first, then applied by the same ``Replay.apply`` that
reading the file uses, so a live conversation and a resumed one cannot drift apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from chatcli.core.template import Message

if TYPE_CHECKING:
    from chatcli.core.files.store import ConversationDir


@dataclass
class ActiveMessage:
    """A message in the context: its text, the exact tokens it contributed and where they sit."""

    mid: int
    role: str
    text: str
    tokens: list[int]
    p0: int
    turn: int
    alt: int = 0
    stop: str = ""
    ts: float = 0.0
    reasoning: str = ""  # a reply's reasoning, apart from its answer (same token ids: ``reasoning_tokens``)
    answer: str | None = None  # the reply without its reasoning; None: ``text`` is all answer
    reasoning_tokens: int = 0  # the reply's first tokens that hold its reasoning (tags included)
    # A user message evaluated in one call with the ``with_closing`` tokens before it, the previous reply's
    # closing (a server decodes that with the next prompt, not after the reply's end): rebuild.py replays it.
    with_closing: int = 0
    # A new conversation's first message whose first ``taken`` cells were the context's last conversation's
    # (``Backend.forget``): only the rest was evaluated, in one call; rebuild.py replays the two parts.
    taken: int = 0

    @property
    def p1(self) -> int:
        return self.p0 + len(self.tokens)

    @property
    def shown(self) -> str:
        """What a reader is shown as the message: the answer (the reasoning is shown apart, on request)."""
        return self.text if self.answer is None else self.answer

    def as_message(self) -> Message:
        return Message(self.role, self.text)


@dataclass
class Replay:
    """The transcript's events folded into the current state of the conversation."""

    prefix_tokens: list[int] = field(default_factory=list)
    persona: str = ""
    persona_messages: list[Message] = field(default_factory=list)
    active: list[ActiveMessage] = field(default_factory=list)
    all: dict[int, dict[str, Any]] = field(default_factory=dict)
    out_of_context: list[int] = field(default_factory=list)  # message ids dropped by context shifts
    redo: list[list[int]] = field(default_factory=list)
    undone: set[int] = field(default_factory=set)
    next_mid: int = 0
    max_turn: int = -1  # turn ids are never reused: after /undo or a shift a new turn gets a new id
    has_prefix: bool = False
    problems: list[str] = field(default_factory=list)
    # The messages a /redo still had to bring back where the transcript ends: /redo writes one activate
    # event per message, and a process killed between them leaves the first ones only (a user message
    # without its reply). Whoever opens the conversation appends the rest (``loading.open_conversation``):
    # a /redo is whole or not at all. Only at the end: once anything else followed, that history stands.
    torn_redo: list[int] = field(default_factory=list)
    # Where the context's end was brought back by /redo or /alt (the activate events the transcript ends
    # with; -1: it ends otherwise): a resume may read those messages' cells back as /redo and /alt do.
    brought_back: int = -1

    def tokens(self) -> list[int]:
        out = list(self.prefix_tokens)
        for m in self.active:
            out.extend(m.tokens)
        return out

    def apply(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if self.torn_redo and not (kind == "activate" and not ev.get("redo") and ev.get("mid") == self.torn_redo[0]):
            self.torn_redo = []  # the redo was followed by something else: it stays as it was written
        if kind == "activate":
            if self.brought_back < 0:
                self.brought_back = int(ev["p0"])
        elif kind in ("prefix", "message", "truncate", "shift"):
            self.brought_back = -1
        if kind == "prefix":
            self.prefix_tokens = [int(t) for t in ev["tokens"]]
            self.persona = str(ev.get("persona", ""))
            self.persona_messages = [Message(m["role"], m["content"]) for m in ev.get("messages", [])]
            self.has_prefix = True
        elif kind == "message":
            # Validated before anything keeps it: a damaged event is skipped whole (replay_events says so),
            # never half-kept where regen, /alt or redo would trip over it later.
            self.next_mid = max(self.next_mid, int(ev["mid"]) + 1)  # never reused, even a damaged one's
            msg = _parse_message(ev)
            self.all[msg.mid] = ev
            self.max_turn = max(self.max_turn, msg.turn)
            self._push(msg)
            self.redo.clear()
        elif kind == "activate":
            mid = int(ev["mid"])
            ev_msg = self.all.get(mid)
            if ev_msg is not None:
                self._push(_parse_message(ev_msg, int(ev["p0"])))
                self.undone.discard(mid)
            if ev.get("redo") and self.redo:
                entry = self.redo.pop()
                self.torn_redo = entry[1:] if entry and entry[0] == mid else []
            elif self.torn_redo:
                self.torn_redo.pop(0)
        elif kind == "truncate":
            to = int(ev["to"])
            removed = [m for m in self.active if m.p0 >= to]
            self.active = [m for m in self.active if m.p0 < to]
            if ev.get("reason") == "undo" and removed:
                self.redo.append([m.mid for m in removed])
                self.undone.update(m.mid for m in removed)
            elif ev.get("reason") != "redo":
                self.redo.clear()
        elif kind == "shift":
            keep, drop = int(ev["keep"]), int(ev["drop"])
            kept: list[ActiveMessage] = []
            for m in self.active:
                if keep <= m.p0 < keep + drop:
                    self.out_of_context.append(m.mid)
                else:
                    if m.p0 >= keep + drop:
                        m.p0 -= drop
                    kept.append(m)
            self.active = kept
        # unknown event types from newer versions are skipped: the transcript stays readable

    def _push(self, msg: ActiveMessage) -> None:
        expected = len(self.prefix_tokens) + sum(len(m.tokens) for m in self.active)
        if msg.p0 != expected:
            self.problems.append(f"message {msg.mid} starts at {msg.p0}, expected {expected}; skipped")
            return
        self.active.append(msg)

    def alternatives(self, turn: int) -> list[dict[str, Any]]:
        return [e for e in self.all.values() if e["role"] == "assistant" and int(e.get("turn", -1)) == turn]


def message_parts(ev: dict[str, Any]) -> tuple[str, str | None, int]:
    """A message event's (reasoning, answer, reasoning tokens). The optional ``reasoning`` and ``answer``
    fields (``{"text", "tokens": [start, end]}``, offsets into the message's tokens) were added without a
    version change: ``text`` keeps meaning the reply as generated, so older chatcli versions read these
    lines as before, and lines without them are all answer."""
    r, a = ev.get("reasoning"), ev.get("answer")
    if not isinstance(r, dict) or not isinstance(a, dict):
        return "", None, 0
    span = r.get("tokens") or [0, 0]
    return str(r.get("text", "")), str(a.get("text", "")), int(span[1]) - int(span[0])


def _parse_message(ev: dict[str, Any], p0: int | None = None) -> ActiveMessage:
    """A message event as an ``ActiveMessage`` at ``p0`` (default: its span's start); raises KeyError,
    TypeError or ValueError when a field is missing or of the wrong kind."""
    role, tokens = ev["role"], ev["tokens"]
    if not isinstance(role, str) or not isinstance(tokens, list):
        raise TypeError("role must be a string and tokens a list")
    reasoning, answer, n_reasoning = message_parts(ev)
    return ActiveMessage(
        mid=int(ev["mid"]), role=role, text=str(ev.get("text", "")), tokens=[int(t) for t in tokens],
        p0=int(ev["span"][0]) if p0 is None else p0, turn=int(ev.get("turn", 0)), alt=int(ev.get("alt", 0)),
        stop=str(ev.get("stop", "")), ts=float(ev.get("ts", 0.0)),
        reasoning=reasoning, answer=answer, reasoning_tokens=n_reasoning,
        with_closing=int(ev.get("with_closing", 0)), taken=int(ev.get("taken", 0)),
    )


def replay_events(events: Sequence[dict[str, Any]]) -> Replay:
    r = Replay()
    for ev in events:
        try:
            r.apply(ev)
        except (KeyError, TypeError, ValueError) as exc:
            r.problems.append(f"transcript event {ev.get('type')!r} is malformed ({exc}); skipped")
    return r


class Transcript:
    """A conversation's transcript file and its replayed state, kept equal."""

    def __init__(self, conv_dir: ConversationDir, replay: Replay) -> None:
        self.dir = conv_dir
        self.r = replay

    def append(self, ev: dict[str, Any]) -> dict[str, Any]:
        """Make ``ev`` durable, then apply it; if the write fails (OSError) nothing is applied."""
        # The timestamp is set here so the applied event is exactly the line on disk.
        ev = {"ts": round(time.time(), 3), **ev}
        self.dir.append_event(ev)
        self.r.apply(ev)
        return ev

    def message(self, role: str, text: str, tokens: list[int], p0: int, turn: int, *, alt: int = 0,
                stop: str = "", parts: dict[str, Any] | None = None, with_closing: int = 0,
                taken: int = 0) -> ActiveMessage:
        """Append a message at position ``p0`` (the end of the context); returns it as now active.
        ``parts``: a reply's reasoning and answer (``reply.reasoning_parts``); ``with_closing`` and ``taken``:
        see ``ActiveMessage`` (optional fields, added without a version change: older versions ignore them)."""
        ev: dict[str, Any] = {"type": "message", "mid": self.r.next_mid, "role": role, "text": text,
                              "tokens": list(tokens), "span": [p0, p0 + len(tokens)], "turn": turn, "alt": alt}
        if stop:
            ev["stop"] = stop
        if parts:
            ev.update(parts)
        if with_closing:
            ev["with_closing"] = with_closing
        if taken:
            ev["taken"] = taken
        self.append(ev)
        msg = self.r.active[-1] if self.r.active else None
        if msg is None or msg.mid != ev["mid"]:
            raise RuntimeError(f"message {ev['mid']} does not continue the context at {p0}")  # a bug, not input
        return msg
