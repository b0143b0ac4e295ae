"""A streaming reply's Markdown: what the REPL shows equals the whole text rendered, at a frame's cost that
does not grow with the reply; the live area's ticker stays idle while text streams."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console
from rich.live import Live

from chatcli.core.events import ReplyEnd, ReplyStart, ReplyText, TurnStats
from chatcli.core.transcript import ActiveMessage
from chatcli.repl.markdown import Line, StreamingMarkdown, next_block_start, render_lines
from chatcli.repl.render import Renderer

PROSE = ("A paragraph of prose with *emphasis* and `code`, long enough to wrap over several lines at sixty "
         "columns wide.\n\n")
REPLIES = [
    "Para one.\n\n# Head\n\nPara two.",
    "Sure! Here are steps:\n\n1. First do this.\n2. Then that.\n\nAnd code:\n\n```python\ndef f():\n\n"
    "    return 1\n```\n\nDone.",
    "Intro\n\n- a\n- b\n\n- c, a loose list\n\nOutro **bold**.",
    "## Title\n\nText with `inline` and a [link](http://x).\n\n> quote here\n> more\n\n> its second para\n\nEnd.",
    "| a | b |\n|---|---|\n| 1 | 2 |\n\nAfter the table.",
    "Text\n\n---\n\nAfter a rule.",
    "1. one\n\n   continued para\n\n2. two\n\nfinal",
    "Heading\n=======\n\nSetext body.\n\nAnother\n---\n\nend",
    "Para\n\n    indented code\n\n    more code\n\nback.",
    "A\n\n\n\nB after many blanks",
    "Code first:\n\n```\nplain\n```\n\n```js\nlet a = 1;\n```\n\n~~~\ntilde\n~~~\n\nend. " * 3,
    PROSE * 12,
]


def console(width: int = 60) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=True, color_system="truecolor")


@pytest.mark.parametrize("reply", REPLIES, ids=range(len(REPLIES)))
def test_every_frame_shows_exactly_the_whole_text_rendered(reply: str) -> None:
    con = console()
    sm = StreamingMarkdown(lambda text, width: render_lines(con, text, width))
    for i in range(1, len(reply) + 1, 3):
        assert sm.lines(reply[:i], 60) == render_lines(con, reply[:i], 60), reply[:i]
    assert sm.lines(reply, 60) == render_lines(con, reply, 60)


def test_a_frame_renders_only_what_follows_the_finished_blocks() -> None:
    con = console()
    sizes: list[int] = []

    def render(text: str, width: int) -> list[Line]:
        sizes.append(len(text))
        return render_lines(con, text, width)

    sm = StreamingMarkdown(render)
    reply = PROSE * 40
    for i in range(1, len(reply) + 1, 4):
        sizes.clear()
        sm.lines(reply[:i], 60)
        # Never more than the block being written and the one before it (while that one is checked).
        assert max(sizes) <= 2 * len(PROSE) + 4, i
    assert len(reply) > 15 * (2 * len(PROSE) + 4)  # the bound is far below the whole reply


def test_a_final_text_that_is_not_the_streamed_one_or_a_new_width_starts_over() -> None:
    con = console(80)
    sm = StreamingMarkdown(lambda text, width: render_lines(con, text, width))
    reply = PROSE * 5
    for i in range(1, len(reply) + 1, 7):
        sm.lines(reply[:i], 60)
    shorter = PROSE * 2 + "The end."
    assert sm.lines(shorter, 60) == render_lines(con, shorter, 60)
    assert sm.lines(reply, 40) == render_lines(con, reply, 40)


def test_block_starts_skip_fences_continuations_and_lines_still_too_short_to_tell() -> None:
    text = "a\n\n```\nx\n\ny\n```\n\n- i\n\n- j\n\n  more\n\nnext para\n"
    starts = []
    b = next_block_start(text, 0)
    while b is not None:
        starts.append(text[b:].split("\n", 1)[0])
        b = next_block_start(text, b)
    assert starts == ["```", "next para"]  # a list item never starts one: a loose list is one list
    assert next_block_start("para\n\n1", 0) is None  # "1" may become "10. item"
    assert next_block_start("para\n\nA new paragraph", 0) == 6


def test_the_live_ticker_stays_idle_while_text_streams_and_ticks_for_a_spinner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ticks: list[float] = []
    refresh = Live.refresh

    def counting(self: Live) -> None:
        if threading.current_thread().name == "chatcli-live":
            ticks.append(time.monotonic())
        refresh(self)

    monkeypatch.setattr(Live, "refresh", counting)
    # Not even awake to look: a thread that runs while ggml's threads decode takes a core from one of them.
    woke: list[float] = []
    wait = threading.Condition.wait

    def watched(self: threading.Condition, timeout: float | None = None) -> bool:
        got = wait(self, timeout)
        if threading.current_thread().name == "chatcli-live":
            woke.append(time.monotonic())
        return got

    monkeypatch.setattr(threading.Condition, "wait", watched)
    out = io.StringIO()
    renderer = Renderer(Console(file=out, width=60, height=20, force_terminal=True, highlight=False))
    reply = "Counting: " + " ".join(f"{i}," for i in range(12))
    msg = ActiveMessage(1, "assistant", reply, [1], 0, 0)
    spans: dict[str, float] = {}

    def events() -> Iterator[Any]:
        yield ReplyStart(0, 0)
        time.sleep(0.45)  # "thinking…": the spinner must move
        for i, piece in enumerate(reply.split(" ")):
            yield ReplyText(piece + " ")
            if i == 0:
                # Here the first piece is on the screen (a first frame takes a while: the spinner moves on
                # until it is shown, rightly).
                spans["text"] = time.monotonic()
            time.sleep(0.05)
        spans["end"] = time.monotonic()
        yield ReplyEnd(msg, TurnStats())

    renderer.stream(events())
    assert any(t < spans["text"] for t in ticks)
    assert not [t for t in ticks if spans["text"] + 0.02 < t < spans["end"]]
    assert not [t for t in woke if spans["text"] + 0.02 < t < spans["end"]]
    assert "Counting: 0," in out.getvalue()


@pytest.mark.parametrize("delay", [0.0, 30.0], ids=["running", "not-started"])
def test_an_operation_streams_only_once_the_markdown_warm_up_is_over(monkeypatch: pytest.MonkeyPatch,
                                                                      delay: float) -> None:
    """The warm-up the CLI starts at the first prompt never runs beside a message's evaluation or its
    reply's decodes: the renderer waits for it (its thread running) or runs it (not started yet) before it
    takes the first event, and no warm-up thread is left."""
    from chatcli.repl import markdown

    spans: list[tuple[float, float, str]] = []

    def slow_warm_up() -> None:
        t0 = time.monotonic()
        time.sleep(0.3)
        spans.append((t0, time.monotonic(), threading.current_thread().name))

    monkeypatch.setattr(markdown, "warm_up", slow_warm_up)
    renderer = Renderer(Console(file=io.StringIO(), width=60, height=20, force_terminal=True))
    renderer.warm = markdown.WarmUp(delay)
    time.sleep(0.05)  # "running": the thread has begun it
    seen: dict[str, Any] = {}

    def events() -> Iterator[Any]:
        seen["first"] = time.monotonic()
        yield ReplyStart(0, 0)
        yield ReplyText("hello")
        yield ReplyEnd(ActiveMessage(1, "assistant", "hello", [1], 0, 0), TurnStats())

    renderer.stream(events())
    assert len(spans) == 1 and spans[0][1] <= seen["first"]
    assert spans[0][2] == ("chatcli-warm-markdown" if delay == 0.0 else "MainThread")
    time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "chatcli-warm-markdown"]  # cancelled or ended


def test_a_piped_reply_is_flushed_at_once_then_at_most_every_window() -> None:
    """Each flush of a piped reply wakes its reader, which takes a core from ggml's decode threads: the
    first token goes out at once, later ones at most every ``PIPE_WINDOW`` (a token waits at most for the
    next), and the whole reply is out at its end."""
    from chatcli.repl.render import PIPE_WINDOW

    class Pipe(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.flushed: list[str] = []

        def flush(self) -> None:
            self.flushed.append(self.getvalue())

    out = Pipe()
    renderer = Renderer(Console(file=out, width=60, highlight=False), plain=True, err=io.StringIO())
    pieces = [f"{i}, " for i in range(40)]
    msg = ActiveMessage(1, "assistant", "".join(pieces), [1], 0, 0)
    seen_first: list[list[str]] = []

    def events(gap: float) -> Iterator[Any]:
        yield ReplyStart(0, 0)
        for i, piece in enumerate(pieces):
            yield ReplyText(piece)
            if i == 0:
                seen_first.append(list(out.flushed))
            time.sleep(gap)
        yield ReplyEnd(msg, TurnStats())

    t0 = time.monotonic()
    renderer.stream(events(0.001))  # ~1000 tokens a second
    took = time.monotonic() - t0
    assert seen_first[0] == ["0, "]  # the first token is never held back
    assert out.flushed[-1] == "".join(pieces) + "\n"
    assert len(out.flushed) <= took / PIPE_WINDOW + 3 < len(pieces)  # not once a token
    out.flushed.clear()
    out.seek(0)
    out.truncate()
    renderer.stream(events(PIPE_WINDOW * 1.5))  # slower than the window: every token at once
    assert len(out.flushed) >= len(pieces)
