"""Markdown rendered to terminal lines, and rendered incrementally while a reply streams.

rich renders Markdown by parsing and laying out the whole text, so a streaming reply re-rendered every
frame costs time in proportion to its length (measured here: ~8 ms a frame at 500 tokens, ~35 ms at
2,000), and the frames run between decodes: a long reply decoded ~10 % slower in the REPL than piped.
``StreamingMarkdown`` freezes the lines of the blocks a reply has finished (paragraphs, lists, code
blocks followed by a blank line and the start of another block) and re-renders only the text after them,
so a frame costs what the last block costs. A block is frozen only when the text rendered in two parts
gives exactly the lines of it rendered whole, so what is shown is what rendering the whole reply shows.
"""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Callable

from rich.console import Console
from rich.segment import Segment

Line = list[Segment]

_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.M)
# A blank line is not the end of a block when the next line continues it: an indented continuation or code,
# a further list item (a loose list is one list), a quote's next paragraph.
_CONTINUES = re.compile(r"[ \t]|[-*+][ \t]|\d{1,9}[.)][ \t]|>")
# A line still being written is long enough to be told apart from those (and from a fence) at this length.
_DECIDED = 12


def drop_dangling_fence(text: str) -> str:
    """A fence that opens nothing at the very end of a reply (small models often close a block they never
    opened; a streaming reply has just opened one) would render as an empty box: leave it out."""
    body = text.rstrip()
    fences = _FENCE.findall(body)
    if len(fences) % 2 == 1:
        last = body.rsplit("\n", 1)[-1]
        if _FENCE.match(last):
            return body[: len(body) - len(last)].rstrip("\n")
    return text


def rstrip_line(line: Line) -> Line:
    """Drop trailing padding so copied text and captures have no trailing blanks (code keeps its background)."""
    out = list(line)
    while out:
        seg = out[-1]
        if seg.control or (seg.style is not None and seg.style.bgcolor is not None):
            break
        text = seg.text.rstrip(" ")
        if text:
            out[-1] = Segment(text, seg.style)
            break
        out.pop()
    return out


def render_lines(console: Console, text: str, width: int) -> list[Line]:
    """``text`` as Markdown, laid out ``width`` cells wide, one list of segments per line."""
    from rich.markdown import Markdown  # here: it loads a Markdown parser that `chatcli ls` never needs

    options = console.options.update(width=width)
    lines = console.render_lines(Markdown(drop_dangling_fence(text)), options, pad=False)
    return [rstrip_line(line) for line in lines]


def next_block_start(text: str, after: int) -> int | None:
    """The offset of the first top-level block that starts after ``after`` and follows a blank line, outside
    code fences, or None. ``after`` must itself be a block start (or 0)."""
    in_fence = False
    blank_before = False
    pos = after
    for line in text[after:].splitlines(keepends=True):
        start, pos = pos, pos + len(line)
        if not line.endswith("\n") and len(line) < _DECIDED:
            # The line still being written: too short yet to tell a new paragraph from "10. item" or "```".
            break
        if _FENCE.match(line):
            if not in_fence and blank_before and start > after:
                return start
            in_fence = not in_fence
            blank_before = False
            continue
        if in_fence:
            continue
        if not line.strip():
            blank_before = True
            continue
        if blank_before and start > after and not _CONTINUES.match(line):
            return start
        blank_before = False
    return None


def _blank(line: Line) -> bool:
    return not any(seg.text.strip() or (seg.style is not None and seg.style.bgcolor is not None) for seg in line)


class StreamingMarkdown:
    """The lines of a growing Markdown text, re-rendering only what follows its finished blocks."""

    def __init__(self, render: Callable[[str, int], list[Line]]) -> None:
        self._render = render
        self._width = -1
        self._frozen_text = ""  # text[:len(_frozen_text)] is rendered for good as _frozen
        self._frozen: list[Line] = []
        self._tried = 0  # a block start at or before this offset failed the check: not tried again

    def lines(self, text: str, width: int) -> list[Line]:
        """The whole text's lines; freezes at most one more finished block per call."""
        if width != self._width or not text.startswith(self._frozen_text):
            # A resized terminal, or a final text that is not the streamed one: start over.
            self._width, self._frozen_text, self._frozen, self._tried = width, "", [], 0
        base = len(self._frozen_text)
        tail = self._render(text[base:], width)
        b = next_block_start(text, max(base, self._tried))
        if b is not None and b > base:
            head = self._render(text[base:b], width)
            rest = self._render(text[b:], width)
            n = len(tail) - len(rest)
            # The next block must show something: an empty one (a fence just opened, left out as dangling)
            # would freeze the head without the blank line that comes before the block once it has lines.
            if (rest and len(head) <= n and tail[:len(head)] == head and tail[n:] == rest
                    and all(_blank(line) for line in tail[len(head):n])):
                self._frozen += tail[:n]
                self._frozen_text = text[:b]
                tail = rest
            else:
                self._tried = b
        return self._frozen + tail


def warm_up() -> None:
    """Import the Markdown parser and a code lexer (the CLI does it while the model loads): the first
    reply's first frame would otherwise pay ~40 ms for them between two decodes."""
    console = Console(file=io.StringIO(), width=80, force_terminal=True)
    render_lines(console, "# t\n\n- a\n\n`x`\n\n```python\nx = 1\n```\n\n| a |\n|---|\n| 1 |", 80)


class WarmUp:
    """``warm_up`` on a thread ``delay`` seconds from now (while the first prompt waits for the user), and
    over before the first operation streams (``finish``).

    A message typed or pasted within the delay, or while the thread still runs, would otherwise have its
    prompt evaluated or its first tokens decoded next to the warm-up: on two cores a third busy thread holds
    up a decode's whole thread team at every barrier, which costs more than the warm-up itself. ``finish``
    runs it in the caller if the thread has not started it, else waits for the thread.
    """

    def __init__(self, delay: float) -> None:
        self._lock = threading.Lock()
        self._claimed = False
        self._over = threading.Event()
        self._timer = threading.Timer(delay, self._run)
        self._timer.name, self._timer.daemon = "chatcli-warm-markdown", True
        self._timer.start()

    def _run(self) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        try:
            warm_up()
        except Exception:  # the first frame renders (and imports) again, which then says what is wrong
            pass
        finally:
            self._over.set()

    def finish(self) -> None:
        """Return once the warm-up is over (run here if its thread had not begun it)."""
        self._timer.cancel()
        self._run()
        self._over.wait()
