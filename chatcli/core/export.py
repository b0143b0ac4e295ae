"""Conversations as Markdown and as OpenAI-style message lists."""

from __future__ import annotations

from typing import Any

from chatcli.core.transcript import Replay


def to_messages(r: Replay) -> list[dict[str, str]]:
    """The active conversation in the OpenAI chat ``messages`` shape (persona messages included)."""
    out = [m.as_dict() for m in r.persona_messages]
    out.extend({"role": m.role, "content": m.text} for m in r.active)
    return out


def to_markdown(meta: dict[str, Any], r: Replay) -> str:
    lines = [f"# {meta.get('title') or 'Conversation ' + str(meta.get('id', ''))}", ""]
    lines.append(f"*chatcli conversation `{meta.get('id', '')}` · persona {meta.get('persona', '')} · "
                 f"model {(meta.get('model') or {}).get('name', '')}*")
    lines.append("")
    for m in r.persona_messages:
        if m.role == "system":
            lines += ["> **system:** " + m.content.replace("\n", "\n> "), ""]
    for m in r.active:
        who = "You" if m.role == "user" else "Assistant"
        lines += [f"**{who}:**", "", m.text, ""]
    return "\n".join(lines).rstrip() + "\n"
