"""Everything chatcli shows: streaming replies, stats lines, notices, history, tables.

The Renderer consumes the core's events; it never decides anything about the conversation.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Iterator, Sequence, TextIO

from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown
from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from chatcli.conversation import ActiveMessage, Event, Notice, Progress, ReplyEnd, ReplyStart, ReplyText, TurnStats


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def stats_line(s: TurnStats) -> str:
    parts = [f"{s.n_eval} tok evaluated"]
    if s.n_generated:
        parts.append(f"ttft {s.ttft * 1000:.0f} ms")
        parts.append(f"{s.tokens_per_second:.1f} tok/s")
    parts.append(f"ctx {s.n_past}/{s.n_ctx}")
    if s.kept is not None:
        parts.append(f"kept {s.kept}, dropped {s.dropped or 0}, re-evaluated {s.reevaluated or 0}")
    if s.state_bytes:
        parts.append(f"saved {human_bytes(s.state_bytes)} in {s.save_ms:.0f} ms")
    if s.stop_reason == "cancelled":
        parts.append("stopped by Ctrl-C: partial reply kept")
    elif s.stop_reason == "length":
        parts.append("stopped at --max-tokens")
    elif s.stop_reason == "context":
        parts.append("stopped: context full")
    return " · ".join(parts)


class Renderer:
    """Rich output for a terminal; plain text (no markup, no colour) for pipes and ``--plain``."""

    def __init__(self, console: Console, *, plain: bool = False, err: TextIO | None = None) -> None:
        self.console = console
        self.plain = plain
        self.err = err if err is not None else sys.stderr

    # -- streaming ---------------------------------------------------------------------------------

    def stream(self, events: Iterable[Event]) -> ReplyEnd | None:
        """Render one operation's events; returns the reply's end event (if there was a reply)."""
        end: ReplyEnd | None = None
        bar: RichProgress | None = None
        task = None
        it = iter(events)
        try:
            for ev in it:
                if isinstance(ev, Progress):
                    if self.plain:
                        continue
                    if bar is None:
                        bar = self._new_bar()
                        bar.start()
                        task = bar.add_task(ev.label, total=ev.total, rate="")
                    rate = f"{ev.done / ev.seconds:.0f} tok/s" if ev.seconds > 0 else ""
                    bar.update(task, completed=ev.done, total=ev.total, description=ev.label, rate=rate)
                    continue
                if bar is not None:
                    bar.stop()
                    bar = None
                if isinstance(ev, ReplyStart):
                    end = self._reply(it)
                elif isinstance(ev, Notice):
                    self.notice(ev.text, ev.level)
        finally:
            if bar is not None:
                bar.stop()
        return end

    def _new_bar(self) -> RichProgress:
        return RichProgress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tok"),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=self.console, transient=True,
        )

    def _reply(self, it: Iterator[Event]) -> ReplyEnd | None:
        text = ""
        end: ReplyEnd | None = None
        if self.plain:
            out = self.console.file
            for ev in it:
                if isinstance(ev, ReplyText):
                    text += ev.text
                    out.write(ev.text)
                    out.flush()
                elif isinstance(ev, ReplyEnd):
                    end = ev
                    break
            out.write("\n")
            out.flush()
            return end
        with Live(Text(""), console=self.console, refresh_per_second=15, vertical_overflow="visible") as live:
            for ev in it:
                if isinstance(ev, ReplyText):
                    text += ev.text
                    live.update(Text(text))
                elif isinstance(ev, ReplyEnd):
                    end = ev
                    # Markdown once complete: rendering partial markdown reflows and flickers.
                    live.update(Markdown(end.message.text or text))
                    break
        return end

    def reply_text(self, text: str) -> None:
        if self.plain:
            print(text, file=self.console.file)
        else:
            self.console.print(Markdown(text))

    def stats(self, s: TurnStats) -> None:
        line = stats_line(s)
        if self.plain:
            print(line, file=self.err)
        else:
            self.console.print(Text(line, style="dim"))

    def notice(self, text: str, level: str = "info") -> None:
        if self.plain:
            prefix = {"warn": "warning: ", "error": "error: "}.get(level, "")
            print(prefix + text, file=self.err)
            return
        style = {"warn": "yellow", "error": "bold red"}.get(level, "dim")
        self.console.print(Text(text, style=style))

    def error(self, text: str) -> None:
        self.notice(text, "error")

    def history(self, messages: Sequence[ActiveMessage], n_exchanges: int) -> None:
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        start = users[-n_exchanges] if len(users) >= n_exchanges and n_exchanges > 0 else 0
        shown = messages[start:] if n_exchanges > 0 else []
        if start > 0 and shown:
            self.notice(f"… {len(users) - n_exchanges} earlier exchange(s)")
        for m in shown:
            who = "you" if m.role == "user" else "assistant"
            if self.plain:
                print(f"{who}: {m.text}", file=self.err)
            else:
                self.console.print(Text(f"{who}: ", style="dim bold") + Text(m.text, style="dim"))

    def table(self, rows: list[dict[str, Any]], columns: list[str], title: str | None = None) -> None:
        if self.plain:
            for r in rows:
                print("\t".join(str(r.get(c, "")) for c in columns), file=self.console.file)
            return
        t = Table(title=title, header_style="bold")
        for c in columns:
            t.add_column(c)
        for r in rows:
            t.add_row(*(str(r.get(c, "")) for c in columns))
        self.console.print(t)

    def json(self, data: Any) -> None:
        self.console.file.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
