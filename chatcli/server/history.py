"""A request's message list as chatcli sees a conversation: a persona prefix, then alternating turns.

A stored conversation is a persona (the messages its prefix was rendered from) followed by user and
assistant messages. A chat client resends that history as a flat list; this module splits it the same way
and gives every message boundary a *chain key* — a hash of the model, the context size, the template, the
persona and every message up to that point — so the history a client sends can be looked up among the
stored conversations (``index.py``) without tokenizing it.

Token identity follows from text identity: the REPL renders each user turn with
``ChatTemplate.user_turn(history, text)`` and stores each reply as the tokens the model produced plus the
template's closing; the server continues a stored conversation only through those same code paths, so a
history that matches by text is the same token sequence as the stored one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from chatcli.core.template import Message, strip_reasoning
from chatcli.errors import ChatcliError, Kind

ROLES = ("system", "user", "assistant")


class HistoryError(ChatcliError, ValueError):
    """The message list cannot be a chatcli conversation (one line for the client)."""

    kind: Kind = "usage"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SplitHistory:
    persona: tuple[Message, ...]  # what the prefix is rendered from (system prompt, greeting, examples)
    turns: tuple[Message, ...]  # user, assistant, user, ... ending with a user message


def normalize(messages: Iterable[Message]) -> list[Message]:
    """Roles as chatcli knows them (``developer`` is OpenAI's newer name for ``system``)."""
    out: list[Message] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if role not in ROLES:
            raise HistoryError(f"unsupported role {m.role!r}: use system, user or assistant", "messages")
        out.append(Message(role, m.content))
    return out


def _merge_runs(turns: Sequence[Message]) -> list[Message]:
    """Consecutive messages of one role joined: a conversation alternates (templates expect it)."""
    out: list[Message] = []
    for m in turns:
        if out and out[-1].role == m.role:
            out[-1] = Message(m.role, out[-1].content + "\n\n" + m.content)
        else:
            out.append(m)
    return out


def split(messages: Sequence[Message], known_personas: Iterable[Sequence[Message]] = ()) -> SplitHistory:
    """Separate the persona from the turns.

    A known persona (one a stored conversation was started with, e.g. a REPL persona with its example
    exchanges and greeting) that the list starts with is taken whole; otherwise the persona is everything
    before the first user message.
    """
    msgs = list(messages)
    if not msgs:
        raise HistoryError("messages must not be empty", "messages")
    n_persona = -1
    for p in sorted(known_personas, key=len, reverse=True):
        if p and len(msgs) > len(p) and tuple(msgs[:len(p)]) == tuple(p) and msgs[len(p)].role == "user":
            n_persona = len(p)
            break
    if n_persona < 0:
        n_persona = next((i for i, m in enumerate(msgs) if m.role == "user"), len(msgs))
    persona, turns = msgs[:n_persona], _merge_runs(msgs[n_persona:])
    if not turns:
        raise HistoryError("the messages hold no user message", "messages")
    for i, m in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if m.role == "system":
            raise HistoryError("system messages are supported only before the first user message", "messages")
        if m.role != want:  # cannot happen after _merge_runs(), kept as a guard
            raise HistoryError(f"expected a {want} message at position {n_persona + i}", "messages")
        if m.role == "user" and not m.content.strip():
            raise HistoryError(f"message {n_persona + i} is empty", "messages")
    if turns[-1].role != "user":
        raise HistoryError("the last message must be a user message", "messages")
    return SplitHistory(tuple(persona), tuple(turns))


def root_key(model_identity: dict[str, Any], n_ctx: int, template_source: str, persona: Sequence[Message]) -> str:
    """Key of a conversation's starting point: everything its prefix tokens depend on."""
    doc = {
        "model": model_identity, "n_ctx": n_ctx,
        "template": hashlib.sha256(template_source.encode()).hexdigest(),
        "persona": [[m.role, m.content] for m in persona],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


def message_key(prev: str, role: str, text: str) -> str:
    # A reply is matched by its answer without surrounding whitespace: clients commonly strip it and send
    # a reply back without its reasoning (or with it in reasoning_content, which is not the content), and
    # the stored tokens (what the model produced, reasoning included) are what the context holds either way.
    if role == "assistant":
        text = strip_reasoning(text).strip()
    h = hashlib.sha256()
    for part in (prev, role, text):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x1f")
    return h.hexdigest()[:32]


def chain(root: str, messages: Iterable[Message]) -> list[str]:
    """Keys after each message: ``out[i]`` identifies the history ``messages[:i+1]``."""
    keys: list[str] = []
    prev = root
    for m in messages:
        prev = message_key(prev, m.role, m.content)
        keys.append(prev)
    return keys


def persona_hash(persona: Sequence[Message]) -> str:
    """Prefix-cache key part for a persona that came from an API request (REPL personas have their own)."""
    doc = json.dumps([[m.role, m.content] for m in persona], ensure_ascii=False, separators=(",", ":"))
    return "api-" + hashlib.sha256(doc.encode("utf-8", "surrogatepass")).hexdigest()
