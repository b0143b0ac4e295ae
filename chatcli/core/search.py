"""Search for `chatcli search` and the REPL's `/search`: index hits, where each one is and how to go on.

The index finds the messages (SQLite FTS5); the exchange a hit belongs to is counted here, by replaying the
hit's transcript (the truth), as `ls` counts turns and `fork --at` takes them, so a hit after an edit or a
`/regen` tells whether it is still on the conversation's path.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from chatcli.core.files.index import HIGHLIGHT, Hit, IndexUnavailable, SearchFilters
from chatcli.core.files.store import ConversationStore, StoreError


@dataclass(frozen=True)
class Found:
    """A hit as front ends show it."""

    id: str
    title: str
    persona: str
    model: str
    source: str
    role: str
    ts: float
    exchange: int | None  # None: the message is no longer on the conversation's path (an older alternative)
    exchanges: int  # how many the conversation has: forking at the last one is just resuming
    snippet: str  # matched words between HIGHLIGHT markers
    in_reasoning: bool

    def how_to_continue(self) -> str:
        if self.exchange is None or self.exchange >= self.exchanges:
            return f"chatcli resume {self.id}"
        return f"chatcli resume {self.id}  ·  chatcli fork {self.id} --at {self.exchange}"


def _date(text: str | None, what: str) -> float | None:
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise StoreError(f"{what}: {text!r} is not a date (YYYY-MM-DD, or YYYY-MM-DDTHH:MM)") from None


def run_search(text: str, store: ConversationStore, *, persona: str | None = None, model: str | None = None,
               since: str | None = None, until: str | None = None, api: bool | None = None,
               reasoning: bool = False, limit: int = 20) -> tuple[list[Found], list[str]]:
    """The hits for ``text``, best first, and the index's notices (rebuilt, repaired) for the front end
    to show. A message written a moment ago (its transcript line) is found."""
    if not text.strip():
        raise StoreError("search: give some words to find")
    filters = SearchFilters(persona=persona, model=model, since=_date(since, "--since"),
                            until=_date(until, "--until"), api=api, reasoning=reasoning)
    index = store.index
    if index is None:
        raise StoreError(f"search needs the index, which cannot be opened ({store.root.parent / 'index.sqlite'})")
    try:
        index.reconcile()
        hits = index.search(text, filters, limit)
    except (sqlite3.Error, IndexUnavailable) as exc:
        raise StoreError(f"search: the index is unusable right now ({exc}); try again") from None
    notices, index.notices[:] = list(index.notices), []
    return [_place(store, h) for h in hits], notices


def _place(store: ConversationStore, hit: Hit) -> Found:
    from chatcli.core.export import exchange_counts
    from chatcli.core.transcript import replay_events

    r = replay_events(store.dir(hit.conv).read_transcript().events)
    path = [*(r.all[m] for m in r.out_of_context if m in r.all), *({"mid": m.mid, "role": m.role} for m in r.active)]
    exchange, n = None, 0
    for m in path:
        n += m.get("role") == "user"
        if int(m.get("mid", -1)) == hit.mid:
            exchange = max(n, 1)
            break
    return Found(hit.conv, hit.title, hit.persona, hit.model, hit.source, hit.role, hit.ts, exchange,
                 exchange_counts(r)[0], hit.snippet, hit.in_reasoning)


def hit_lines(hits: list[Found], *, bold: bool) -> list[str]:
    """Two lines per hit: where it is, then the snippet (matched words bold, or in «»)."""
    on, off = ("\x1b[1m", "\x1b[0m") if bold else ("«", "»")
    out = []
    for h in hits:
        where = f"exchange {h.exchange}" if h.exchange is not None else "an earlier alternative"
        when = datetime.fromtimestamp(h.ts).strftime("%Y-%m-%d %H:%M") if h.ts else ""
        tag = " (reasoning)" if h.in_reasoning else ""
        out.append(f"{h.id}  {h.title or '(untitled)'} · {h.persona} · {where} · {h.role}{tag} · {when}")
        snippet = " ".join(_clean(h.snippet).split())
        out.append("    " + snippet.replace(HIGHLIGHT[0], on).replace(HIGHLIGHT[1], off))
        out.append(f"    → {h.how_to_continue()}")
    return out


def _clean(text: str) -> str:
    # User text never drives the terminal: control characters other than the highlight markers are spaces.
    return "".join(ch if ch in HIGHLIGHT or ch >= " " or ch == "\n" else " " for ch in text)


def hits_json(hits: list[Found]) -> str:
    rows: list[dict[str, Any]] = []
    for h in hits:
        d = asdict(h)
        d["snippet"] = h.snippet.replace(HIGHLIGHT[0], "«").replace(HIGHLIGHT[1], "»")
        d["continue"] = h.how_to_continue()
        rows.append(d)
    return json.dumps(rows, indent=2, ensure_ascii=False)
