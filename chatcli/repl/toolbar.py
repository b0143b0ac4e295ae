"""The REPL's bottom toolbar: persona, model, conversation id, context use, state size and key hints, with
the least important pieces dropped first when the terminal is narrow."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from prompt_toolkit.formatted_text import HTML

from chatcli.repl.context import ChatConversation
from chatcli.units import format_size

if TYPE_CHECKING:
    from chatcli.session import Session


def toolbar_parts(conv: ChatConversation, session: Session | None, hint: str) -> list[tuple[int, str, str]]:
    """The toolbar's pieces as (priority, plain text, markup); lower priorities go first when narrow.
    ``hint``: a transient message (e.g. "Ctrl-C again to exit") shown instead of the key help."""
    use = conv.context
    frac = use.fraction
    bar = context_bar(frac)
    s = session
    # A llama-server session has no local model file: its name comes from the server.
    model = "?" if s is None else s.model.info.name if s.model is not None else s.model_name
    if len(model) > 24:
        model = model[:23] + "…"
    persona = conv.persona_name
    ctx = f"ctx {use.n_past}/{use.n_ctx} {bar}"
    ctx_markup = f"ctx {use.n_past}/{use.n_ctx} {esc(bar)}"
    if frac >= 0.9:
        ctx_markup = f"<b>{ctx_markup}</b>"
    state = f"state {format_size(conv.state_bytes())}"
    keys = hint or "/help · Ctrl-D exit"
    keys_markup = f"<b>{esc(hint)}</b>" if hint else esc(keys)
    # In display order; the priorities decide what stays when the terminal is narrow.
    return [
        (9, persona, f"<b>{esc(persona)}</b>"),
        (5, model, esc(model)),
        (6, conv.id, esc(conv.id)),
        (8, ctx, ctx_markup),
        (3, state, esc(state)),
        (7 if hint else 4, keys, keys_markup),
    ]


def toolbar_line(parts: list[tuple[int, str, str]], width: int | None = None) -> HTML:
    """``parts`` joined into one line of at most ``width`` columns (default: the terminal's)."""
    if width is None:
        width = _terminal_columns()
    sep = " · "
    shown = list(parts)
    # Drop the least important pieces until the line fits (narrow terminals).
    while len(shown) > 1 and 1 + sum(len(p[1]) for p in shown) + len(sep) * (len(shown) - 1) > width:
        shown.remove(min(shown, key=lambda p: p[0]))
    return HTML(" " + sep.join(p[2] for p in shown))


def context_bar(frac: float, width: int = 10) -> str:
    """A bar of ``width`` cells, in eighths, showing how full the context is."""
    eighths = round(max(0.0, min(1.0, frac)) * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    return bar + "░" * (width - len(bar))


def esc(text: object) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _terminal_columns() -> int:
    try:
        from prompt_toolkit.application.current import get_app

        return get_app().output.get_size().columns
    except Exception:
        return shutil.get_terminal_size().columns
