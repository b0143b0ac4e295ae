"""Everything chatcli shows: streaming replies, stats lines, notices, history, tables.

The Renderer consumes the core's events; it never decides anything about the conversation.

Streaming in a terminal uses one ``rich.live.Live`` per operation (always through ``with``). A reply is
rendered as Markdown while it streams; the live area never grows taller than the screen: lines that
would scroll off are printed for good above it, so nothing is lost or duplicated however long the reply
is, and the text is rendered once more from the final message when the reply ends.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, TextIO, TypeVar, cast

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.progress import BarColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.segment import Segment
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from chatcli.core.events import Event, Notice, Progress, ReplyEnd, ReplyStart, ReplyText, TurnStats
from chatcli.core.transcript import ActiveMessage
from chatcli.repl.markdown import StreamingMarkdown, WarmUp, render_lines
from chatcli.units import counted, format_size

# Prose is hard to read in very wide lines: replies are laid out at most this wide.
MAX_REPLY_WIDTH = 100
# Nothing appears for operations shorter than this; longer ones get a spinner.
SPINNER_DELAY = 0.3
# A piped reply is flushed at most this often (the first token at once; text waits at most one token): each
# flush wakes the reader, which then takes a core from one of ggml's decode threads. serve's stream waits
# as long for more text (server/bridge.py WINDOW: there 20 ms made each decode 2-3 % slower, 50 ms 0-1 %).
PIPE_WINDOW = 0.05
# Markdown is re-rendered at most this often while a reply streams...
FRAME_SECONDS = 1 / 10
# ...and rendering may take at most this share of the time: it runs between two decodes, so its time is the
# decode rate's (issue #22 leaves 3 % for all talk adds to llama.cpp's rate). A frame of a short reply takes
# ~0.5 ms and keeps the 10 a second; one that takes 1.5 ms (a long reply, or a busy machine's cold caches:
# measured in a pty) waits 0.15 s.
RENDER_SHARE = 0.01

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

T = TypeVar("T")


def stats_line(s: TurnStats) -> str:
    parts = [f"{s.n_eval} tok evaluated"]
    if s.n_generated:
        parts.append(f"ttft {s.ttft * 1000:.0f} ms")
        parts.append(f"{s.tokens_per_second:.1f} tok/s")
    if s.n_prompt and s.prompt_seconds > 0:
        parts.append(f"prompt {s.n_prompt / s.prompt_seconds:.0f} tok/s")  # the new message, evaluated
    parts.append(f"ctx {s.n_past}/{s.n_ctx}")
    if s.server_evaluated is not None:
        parts.append(f"server evaluated {s.server_evaluated}, reused {s.server_cached or 0}")
    if s.kept is not None:
        parts.append(f"kept {s.kept}, dropped {s.dropped or 0}, re-evaluated {s.reevaluated or 0}")
    if s.state_bytes:
        parts.append(f"saved {format_size(s.state_bytes)} in {s.save_ms:.0f} ms")
    if s.stop_reason == "cancelled":
        parts.append("stopped by Ctrl-C: partial reply kept")
    elif s.stop_reason == "length":
        parts.append("stopped at --max-tokens")
    elif s.stop_reason == "context":
        parts.append("stopped: context full")
    return " · ".join(parts)


class _Lines:
    """Pre-rendered lines as a renderable.

    Printed (``end=True``) each line ends with a newline; shown in a live area the last one must not,
    or the area's next redraw starts a line too low.
    """

    def __init__(self, lines: Sequence[list[Segment]], *, end: bool = False) -> None:
        self.lines = lines
        self.end = end

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for i, line in enumerate(self.lines):
            if i:
                yield Segment.line()
            yield from line
        if self.end and self.lines:
            yield Segment.line()


class _Waiting:
    """Nothing for a moment, then a spinner: quick operations do not flash, slow ones are never silent."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = time.monotonic()
        self.spinner = Spinner("dots", style="dim")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        elapsed = time.monotonic() - self.t0
        if elapsed >= SPINNER_DELAY:
            self.spinner.text = Text(self.label + (f" {elapsed:.0f} s" if elapsed >= 2 else ""), style="dim")
            yield self.spinner


class _Area:
    """The live area of one operation: what is shown in it, and what is printed for good above it.

    rich's own refresh thread renders concurrently with prints from the main thread, which garbles
    the screen when a reply is committed line by line; here one lock serialises both, and a small
    ticker keeps spinners and progress bars moving while the main thread is blocked in the model. It
    refreshes only while one is shown: a streaming reply's text changes only when a frame shows it, and
    each wasted refresh takes the CPU (and the GIL) from the decode threads.
    """

    def __init__(self, live: Live, interval: float = 0.1) -> None:
        self.live = live
        self.lock = threading.RLock()
        # The ticker sleeps on this while nothing is animated (a streaming reply): not even a 10 Hz wake-up
        # to look, since a thread that runs while ggml's threads decode takes a core from one of them and
        # stalls each of that decode's barriers.
        self._wake = threading.Condition(self.lock)
        self._closed = False
        self._interval = interval
        self._animated = True
        self._thread = threading.Thread(target=self._tick, name="chatcli-live", daemon=True)

    def __enter__(self) -> _Area:
        if self.live.console.is_terminal:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self._closed = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _tick(self) -> None:
        with self.lock:
            while not self._closed:
                if not self._animated:
                    self._wake.wait()
                    continue
                self._wake.wait(self._interval)
                if self._animated and not self._closed:
                    self.live.refresh()

    def show(self, renderable: Any) -> None:
        with self.lock:
            was = self._animated
            self._animated = isinstance(renderable, (_Waiting, RichProgress))
            self.live.update(renderable, refresh=True)
            if self._animated != was:
                self._wake.notify()  # ticking from now on, or asleep from now on (not at its next tick)

    def print(self, renderable: Any) -> None:
        with self.lock:
            self.live.console.print(renderable)

    @property
    def console(self) -> Console:
        return self.live.console


class _Bar:
    """The progress bar of an evaluation (a long message, a rebuild): its label, tokens done of the total and
    the rate; ``stream`` and ``steps`` show the same one."""

    def __init__(self, console: Console) -> None:
        self.progress = RichProgress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tok"),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console, auto_refresh=False,
        )
        self.task: TaskID | None = None

    def show(self, ev: Progress, area: _Area) -> None:
        if self.task is None:
            self.task = self.progress.add_task(ev.label, total=ev.total, rate="")
        rate = f"{ev.done / ev.seconds:.0f} tok/s" if ev.seconds > 0 else ""
        with area.lock:
            self.progress.update(self.task, completed=ev.done, total=ev.total, description=ev.label, rate=rate)
            area.show(self.progress)


class _ReplyView:
    """A streaming reply: Markdown, re-rendered in frames, committed above the live area as it grows."""

    def __init__(self, renderer: Renderer, area: _Area) -> None:
        self.renderer = renderer
        self.area = area
        self.console = renderer.console
        self.text = ""
        self.markdown = StreamingMarkdown(lambda text, width: render_lines(self.console, text, width))
        self.committed = 0  # lines already printed for good
        self.next_frame = 0.0
        self.reasoning = ""
        self.n_reasoning = 0
        self.reasoning_done = False

    def add_reasoning(self, piece: str) -> None:
        """Reasoning streams as one dim line (its token count and latest words), apart from the answer."""
        self.reasoning += piece
        self.n_reasoning += 1
        now = time.monotonic()
        if now >= self.next_frame:
            width = max(20, min(self.console.width, self.renderer.max_width))
            self.area.show(self.renderer.reasoning_line(self.reasoning, self.n_reasoning, width))
            self.next_frame = time.monotonic() + FRAME_SECONDS

    def end_reasoning(self, n_tokens: int | None = None) -> None:
        """Print the reasoning above for good (folded, or in full with ``show_reasoning``), once."""
        if self.reasoning and not self.reasoning_done:
            self.reasoning_done = True
            for r in self.renderer.reasoning_renderables(self.reasoning, n_tokens or self.n_reasoning):
                self.area.print(r)

    def add(self, piece: str) -> None:
        self.end_reasoning()
        self.text += piece
        now = time.monotonic()
        if now >= self.next_frame:
            self.render()
            spent = time.monotonic() - now
            self.next_frame = time.monotonic() + max(FRAME_SECONDS, spent / RENDER_SHARE)

    def render(self, final: bool = False) -> None:
        lines = self.markdown.lines(self.text, self.renderer.reply_width)
        # Keep at most a screenful live: a live area taller than the screen cannot be redrawn in place.
        keep = 0 if final else max(1, self.console.size.height - 2)
        cut = max(self.committed, len(lines) - keep)
        with self.area.lock:
            if cut > self.committed:
                self.area.print(_Lines(lines[self.committed:cut], end=True))
                self.committed = cut
            rest = lines[self.committed:]
            self.area.show(_Lines(rest) if rest else Text(""))

    def finish(self, text: str) -> None:
        self.text = text
        self.render(final=True)


class Renderer:
    """Rich output for a terminal; plain text (no markup, no colour) for pipes and ``--plain``."""

    def __init__(self, console: Console, *, plain: bool = False, err: TextIO | None = None,
                 max_width: int = MAX_REPLY_WIDTH, show_reasoning: bool = False) -> None:
        self.console = console
        self.plain = plain
        self._err = err
        self.max_width = max_width
        self.show_reasoning = show_reasoning  # a reply's reasoning in full (dim), not folded to one line
        # The Markdown warm-up the CLI started (``markdown.WarmUp``): over before an operation streams, so
        # its prompt and its decodes never share the CPU with it.
        self.warm: WarmUp | None = None

    @property
    def err(self) -> TextIO:
        # Looked up late: pytest and CliRunner swap sys.stderr after the renderer may have been built.
        return self._err if self._err is not None else sys.stderr

    # -- streaming ---------------------------------------------------------------------------------

    def stream(self, events: Iterable[Event], label: str = "working") -> ReplyEnd | None:
        """Render one operation's events; returns the reply's end event (if there was a reply)."""
        if self.plain:
            return self._stream_plain(iter(events))
        if self.warm is not None:
            self.warm.finish()  # before the events start: iterating them evaluates the message
            self.warm = None
        end: ReplyEnd | None = None
        it = iter(events)
        with Live(_Waiting(label + "…"), console=self.console, auto_refresh=False, transient=True,
                  redirect_stdout=False, redirect_stderr=False) as live, _Area(live) as area:
            bar: _Bar | None = None
            for ev in it:
                if isinstance(ev, Progress):
                    bar = bar or _Bar(self.console)
                    bar.show(ev, area)
                    continue
                bar = None
                if isinstance(ev, ReplyStart):
                    end = self._reply(it, area)
                    area.show(_Waiting(label + "…"))
                elif isinstance(ev, Notice):
                    area.print(self._notice_text(ev.text, ev.level))
                    area.show(_Waiting(label + "…"))
        return end

    def steps(self, steps: Generator[Progress, None, T], label: str = "working") -> T:
        """Run an operation that returns its result (``/undo``, ``/redo``, ``/alt``) and return it, shown as
        ``stream`` shows an operation: nothing for a moment, then a spinner, and the same bar from the first
        ``Progress`` (a rollback rebuilt from a saved point). A plain truncation, done in milliseconds, draws
        nothing; plain mode draws nothing ever. The steps are closed on the way out (a rendering error):
        they then finish unseen, as they must."""
        try:
            if self.plain:
                while True:
                    try:
                        next(steps)
                    except StopIteration as stop:
                        return cast(T, stop.value)
            with Live(_Waiting(label + "…"), console=self.console, auto_refresh=False, transient=True,
                      redirect_stdout=False, redirect_stderr=False) as live, _Area(live) as area:
                bar: _Bar | None = None
                while True:
                    try:
                        ev = next(steps)
                    except StopIteration as stop:
                        return cast(T, stop.value)
                    bar = bar or _Bar(self.console)
                    bar.show(ev, area)
        finally:
            steps.close()

    def _stream_plain(self, it: Iterator[Event]) -> ReplyEnd | None:
        end: ReplyEnd | None = None
        for ev in it:
            if isinstance(ev, ReplyStart):
                end = self._reply_plain(it)
            elif isinstance(ev, Notice):
                self.notice(ev.text, ev.level)
        return end

    def _reply_plain(self, it: Iterator[Event]) -> ReplyEnd | None:
        end: ReplyEnd | None = None
        out = self.console.file
        sanitize = _isatty(out)  # a model's stray escape codes must not drive the user's terminal
        reasoning, n_reasoning, said = "", 0, False
        flushed = -PIPE_WINDOW
        try:
            for ev in it:
                if isinstance(ev, ReplyText) and ev.reasoning:
                    reasoning += ev.text  # not on stdout, which holds only replies: said on stderr
                    n_reasoning += 1
                elif isinstance(ev, ReplyText):
                    if reasoning and not said:
                        said = True
                        self.reasoning(reasoning, n_reasoning, full=self.show_reasoning)
                    out.write(_CONTROL.sub("", ev.text) if sanitize else ev.text)
                    now = time.monotonic()
                    if now - flushed >= PIPE_WINDOW:
                        out.flush()
                        flushed = now
                elif isinstance(ev, ReplyEnd):
                    end = ev
                    break
        finally:
            if reasoning and not said:  # a reply that never got past its reasoning
                self.reasoning(reasoning, n_reasoning, full=self.show_reasoning)
            out.write("\n")  # the reply's line ends even when an error cut it short
            out.flush()
        return end

    def _reply(self, it: Iterator[Event], area: _Area) -> ReplyEnd | None:
        view = _ReplyView(self, area)
        area.show(_Waiting("thinking…"))
        done = False
        try:
            for ev in it:
                if isinstance(ev, ReplyText) and ev.reasoning:
                    view.add_reasoning(ev.text)
                elif isinstance(ev, ReplyText):
                    view.add(ev.text)
                elif isinstance(ev, ReplyEnd):
                    done = True
                    view.end_reasoning(ev.message.reasoning_tokens or None)
                    view.finish(ev.message.shown)
                    return ev
        finally:
            if not done:
                view.end_reasoning()
                view.finish(view.text)  # ended without a ReplyEnd (an error): keep what was shown
        return None

    @property
    def reply_width(self) -> int:
        return max(10, min(self.console.width, self.max_width))

    def markdown_lines(self, text: str) -> list[list[Segment]]:
        return render_lines(self.console, text, self.reply_width)

    # -- one-off output ------------------------------------------------------------------------------

    def reasoning_line(self, reasoning: str, n_tokens: int, width: int) -> Text:
        """Reasoning folded to one dim line: its size and (while it streams) its latest words."""
        head = f"thinking · {n_tokens} tok · "
        words = " ".join(reasoning.split())
        room = max(0, width - len(head) - 1)
        tail = words if len(words) <= room else "…" + words[len(words) - room + 1:]
        return Text(head + tail, style="dim", no_wrap=True, overflow="ellipsis")

    def reasoning_renderables(self, reasoning: str, n_tokens: int) -> list[Text]:
        if self.show_reasoning:
            return [Text(f"thinking · {n_tokens} tok", style="dim"), Text(reasoning.strip(), style="dim")]
        return [Text(f"thinking · {n_tokens} tok · /think shows it", style="dim")]

    def reasoning(self, reasoning: str, n_tokens: int, *, full: bool) -> None:
        """A reply's reasoning outside a streaming reply: folded to one line, or in full (``/think``)."""
        if self.plain:
            print(f"thinking · {n_tokens} tok" + (":\n" + reasoning.strip() if full else " · /think shows it"),
                  file=self.err)
            return
        if full:
            self.console.print(Text(f"thinking · {n_tokens} tok", style="dim"))
            self.console.print(Text(reasoning.strip(), style="dim"))
        else:
            for r in self.reasoning_renderables(reasoning, n_tokens):
                self.console.print(r)

    def reply_text(self, text: str) -> None:
        if self.plain:
            print(text, file=self.console.file)
        else:
            self.console.print(_Lines(self.markdown_lines(text), end=True))

    def stats(self, s: TurnStats) -> None:
        line = stats_line(s)
        if self.plain:
            print(line, file=self.err)
        else:
            self.console.print(Text(line, style="dim"))
            self.console.print()  # a blank line between one exchange and the next

    def _notice_text(self, text: str, level: str) -> Text:
        if level == "error":
            return Text("error: ", style="bold red") + Text(text, style="red")
        if level == "warn":
            return Text("warning: ", style="bold yellow") + Text(text, style="yellow")
        return Text(text, style="dim")

    def notice(self, text: str, level: str = "info") -> None:
        if self.plain:
            prefix = {"warn": "warning: ", "error": "error: "}.get(level, "")
            print(prefix + text, file=self.err)
            return
        self.console.print(self._notice_text(text, level))

    def error(self, text: str) -> None:
        self.notice(text, "error")

    def history(self, messages: Sequence[ActiveMessage], n_exchanges: int) -> None:
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        start = users[-n_exchanges] if len(users) >= n_exchanges and n_exchanges > 0 else 0
        shown = messages[start:] if n_exchanges > 0 else []
        if start > 0 and shown:
            self.notice(f"… {counted(len(users) - n_exchanges, 'earlier exchange')}")
        for m in shown:
            who = "you" if m.role == "user" else "assistant"
            if self.plain:
                print(f"{who}: {m.shown}", file=self.err)
            elif m.role == "user":
                # As it looked when typed, so a resumed session reads on from where it stopped.
                self.console.print(Text("› ", style="bold") + Text(m.text))
            else:
                if m.reasoning:
                    self.reasoning(m.reasoning, m.reasoning_tokens, full=self.show_reasoning)
                self.console.print(_Lines(self.markdown_lines(m.shown), end=True))

    def commands(self, rows: Sequence[tuple[str, str]], footer: str = "") -> None:
        """A command reference: one line per command (wrapped only where the terminal is too narrow)."""
        if self.plain:
            w = max((len(c) for c, _ in rows), default=0)
            for cmd, what in rows:
                print(f"{cmd.ljust(w)}  {what}", file=self.err)
            if footer:
                print(footer, file=self.err)
            return
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column()
        for cmd, what in rows:
            grid.add_row(Text(cmd), Text(what))  # Text: "[code]" is an argument, not markup
        self.console.print(grid)
        if footer:
            self.console.print(Text(footer, style="dim"))

    def fields(self, title: str, rows: Sequence[tuple[str, str]]) -> None:
        """A titled list of ``name: value`` lines (``/stats``)."""
        if self.plain:
            print(title, file=self.err)
            for k, v in rows:
                print(f"  {k}: {v}", file=self.err)
            return
        self.console.print(Text(title, style="bold"))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column()
        for k, v in rows:
            grid.add_row(Text("  " + k), Text(v))
        self.console.print(grid)

    def table(self, rows: list[dict[str, Any]], columns: list[str], title: str | None = None, *,
              to_err: bool = False) -> None:
        """A table; ``to_err`` sends the plain form to stderr (REPL output that is not a reply)."""
        if self.plain:
            out = self.err if to_err else self.console.file
            for r in rows:
                print("\t".join(str(r.get(c, "")) for c in columns), file=out)
            return
        t = Table(title=title, header_style="bold")
        for c in columns:
            t.add_column(c)
        for r in rows:
            t.add_row(*(Text(str(r.get(c, ""))) for c in columns))  # user text is never markup
        self.console.print(t)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

