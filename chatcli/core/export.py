"""Conversations as Markdown and as OpenAI-style message lists.

An export is the whole conversation: every message of its active path (through alternatives, edits and
undos), those that left the model's context in a context shift included. ``in_context=True`` gives only
what the context still holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chatcli.core.transcript import Replay, message_parts


@dataclass(frozen=True)
class PathMessage:
    role: str
    text: str  # what a reader is shown: a reply's answer (its reasoning apart)
    in_context: bool
    reasoning: str = ""


def conversation_path(r: Replay, *, in_context: bool = False) -> list[PathMessage]:
    """The conversation's messages in order (persona messages excluded).

    A context shift drops the oldest messages of the context, so those that left it come first, in the
    order they left; rollbacks only ever remove messages still in the context.
    """
    out: list[PathMessage] = []
    if not in_context:
        for mid in r.out_of_context:
            ev = r.all.get(mid)
            if ev is not None:
                reasoning, answer, _ = message_parts(ev)
                text = str(ev.get("text", "")) if answer is None else answer
                out.append(PathMessage(str(ev.get("role", "")), text, False, reasoning))
    out.extend(PathMessage(m.role, m.shown, True, m.reasoning) for m in r.active)
    return out


def exchange_counts(r: Replay) -> tuple[int, int]:
    """Exchanges (user messages) of the whole conversation, and how many of them are still in context."""
    path = conversation_path(r)
    return sum(m.role == "user" for m in path), sum(m.role == "user" and m.in_context for m in path)


def to_messages(r: Replay, *, in_context: bool = False, reasoning: bool = False) -> list[dict[str, str]]:
    """The conversation in the OpenAI chat ``messages`` shape (persona messages included); with
    ``reasoning`` a reply's reasoning goes in ``reasoning_content`` (the DeepSeek API's field)."""
    out = [m.as_dict() for m in r.persona_messages]
    for m in conversation_path(r, in_context=in_context):
        d = {"role": m.role, "content": m.text}
        if reasoning and m.reasoning:
            d["reasoning_content"] = m.reasoning
        out.append(d)
    return out


def to_markdown(meta: dict[str, Any], r: Replay, *, in_context: bool = False, reasoning: bool = False) -> str:
    lines = [f"# {meta.get('title') or 'Conversation ' + str(meta.get('id', ''))}", ""]
    lines.append(f"*chatcli conversation `{meta.get('id', '')}` · persona {meta.get('persona', '')} · "
                 f"model {(meta.get('model') or {}).get('name', '')}*")
    lines.append("")
    for p in r.persona_messages:
        if p.role == "system":
            lines += ["> **system:** " + p.content.replace("\n", "\n> "), ""]
    for m in conversation_path(r, in_context=in_context):
        who = "You" if m.role == "user" else "Assistant"
        lines += [f"**{who}:**", ""]
        if reasoning and m.reasoning:
            lines += ["> *reasoning:* " + m.reasoning.replace("\n", "\n> "), ""]
        lines += [m.text, ""]
    return "\n".join(lines).rstrip() + "\n"
