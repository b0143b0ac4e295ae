"""Rebuilding a context from the transcript's token ids, bit-identical to the process that built it.

llama.cpp's results depend on how tokens were batched: a reply decoded one token at a time leaves other
KV bits (and later logits) than the same tokens evaluated in one 512-token batch, enough to flip a greedy
choice later on (measured on SmolLM2: a conversation rebuilt in one batch replied differently). So a
rebuild replays the original batching, which the transcript determines:

- the persona prefix: one evaluation (``Engine.eval_steps``: batches of ``n_batch`` from its start);
- a user message: one evaluation;
- a reply: each sampled token decoded alone, then the template's closing (e.g. the ``\\n`` after
  ``<|im_end|>``) in one evaluation;
- a reply a client wrote (``stop == "client"``, appended by the server): one evaluation, closing included;
- a user message whose ``with_closing`` is set (a server's: it leaves a reply's end, its last sampled token
  and its closing, to the next prompt, as llama-server does): one evaluation with the ``with_closing`` tokens
  before it (older servers folded the closing alone: the same rule reads their transcripts);
- a new conversation's first message whose first ``taken`` tokens' cells were taken up from the context's
  previous conversation (``Backend.forget``, the server's): those as one evaluation, then the rest. The
  cells taken were computed in that conversation's call; llama.cpp computes a row the same in any call of
  two tokens or more (``Engine.kept`` takes no fewer and leaves no fewer), which the ``kept`` check of
  tests/kind_checks.py holds on every architecture, rebuild included.

Then an evicted conversation (or one resumed with another KV type, or whose state was damaged) continues
exactly as if its state had been loaded. The cost: reply tokens are decoded one by one, as when they were
generated (bench/results/kvtypes.md measures it). After a context shift the live process holds rotated K
cells that no rebuild reproduces; those conversations are rebuilt the same way, close but not bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol


class _Message(Protocol):
    role: str
    tokens: list[int]
    p0: int
    stop: str
    with_closing: int
    taken: int


class _Engine(Protocol):
    def eval_steps(self, tokens: Sequence[int]) -> Iterator[tuple[int, int]]: ...


def segments(prefix_len: int, messages: Sequence[_Message], closing_len: Callable[[int], int]) -> list[tuple[int, int]]:
    """The ranges [p0, p1) that were evaluated as one call each, in order; ``closing_len(i)`` is how many
    tokens at the end of message ``i`` (a reply) are the template's closing."""
    out: list[tuple[int, int]] = []
    if prefix_len:
        out.append((0, prefix_len))
    for i, m in enumerate(messages):
        p0, p1 = m.p0, m.p0 + len(m.tokens)
        if m.role != "assistant" or m.stop == "client":  # evaluated as one call when it was appended
            start = max(p0 - m.with_closing, messages[i - 1].p0 if i else prefix_len)  # within the reply before
            if start < p0:
                # The end of the reply before (its last token, its closing) and this message: one call.
                while out and out[-1][0] >= start:
                    out.pop()
                if out and out[-1][1] > start:
                    out[-1] = (out[-1][0], start)
                out.append((start, p1))
            elif 0 < m.taken < p1 - p0:
                out += [(p0, p0 + m.taken), (p0 + m.taken, p1)]
            elif p1 > p0:
                out.append((p0, p1))
            continue
        n_close = max(0, min(closing_len(i), p1 - p0))
        out.extend((p, p + 1) for p in range(p0, p1 - n_close))
        if n_close:
            out.append((p1 - n_close, p1))
    return out


def evaluate(engine: _Engine, want: Sequence[int], start: int, plan: list[tuple[int, int]], *,
             stops: Sequence[int] = (), at: Callable[[int], None] | None = None) -> Iterator[tuple[int, int]]:
    """Evaluate ``want[start:]`` following ``plan``; yields (done, total) now and then, for a progress bar
    (after every call of more than one token, every 16 tokens of single ones, and between the batches of a call).

    Ranges the plan does not cover (it always should) are evaluated as one call. ``at(pos)`` is called
    whenever the evaluation reaches a position of ``stops`` (message ends: a memory that cannot be cut back
    saves its state there); a plan range that spans a stop is evaluated in two calls only if the plan
    itself splits there, which it does at every message end.
    """
    total = len(want) - start
    pos = start
    last_report = 0
    pending = sorted(p for p in stops if p > start)

    def reached() -> None:
        while pending and pending[0] <= pos:
            if pending.pop(0) == pos and at is not None:
                at(pos)

    def run(p1: int) -> Iterator[tuple[int, int]]:
        """One evaluation call up to ``p1``; a long one (a persona, a pasted message) reports its batches."""
        nonlocal pos
        base = pos
        for done, n in engine.eval_steps(want[pos:p1]):
            if done < n:
                yield base + done - start, total
        pos = p1
        reached()

    for p0, p1 in plan:
        p1 = min(p1, len(want))
        if p1 <= pos:
            continue
        if p0 > pos:  # a gap in the plan: evaluate it plainly
            yield from run(p0)
        yield from run(p1)
        if pos - start - last_report >= 16 or p1 - p0 > 1:
            last_report = pos - start
            yield last_report, total
    if pos < len(want):
        yield from run(len(want))
    if pos - start != last_report:
        yield pos - start, total


__all__ = ["evaluate", "segments"]
