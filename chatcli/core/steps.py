"""Running the core's steps: ``evaluate`` puts tokens into the context with a ``Progress`` per batch, and
``drain`` runs an operation's or an opening's events to their end for a caller with no screen.

The core's long operations are generators of events (``core.events``) that front ends render; these are
the only loops that turn batches into progress and events into results, so every caller reports progress
and stops early the same way (``to_the_end``: evaluation that must not stop halfway finishes when closed;
``finish``: the same steps run without a screen). Nothing here prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast, overload

from chatcli.core.backend import Backend
from chatcli.core.events import Event, Notice, Progress, ReplyEnd, ResumeReport
from chatcli.core.opening import Opening

C = TypeVar("C")
T = TypeVar("T")


def progress(steps: Iterable[tuple[int, int]], label: str, *, stoppable: bool = False, above: int = 0,
             since: float | None = None) -> Generator[Progress, None, float]:
    """One ``Progress(label, done, total, seconds)`` per ``(done, total)`` step, when ``total`` is more than
    ``above`` (short evaluations show no bar); returns the seconds the steps took. ``stoppable``: the
    caller may close the generator between two steps (a message being read, taken back out). ``since``: the
    ``time.perf_counter()`` the seconds count from (default: when the first step starts), for work done
    before the steps that the bar should include."""
    t0 = time.perf_counter() if since is None else since
    for done, total in steps:
        if total > above:
            yield Progress(label, done, total, time.perf_counter() - t0, stoppable=stoppable)
    return time.perf_counter() - t0


def evaluate(backend: Backend, tokens: Sequence[int], label: str, *, stoppable: bool = False,
             above: int = 0) -> Generator[Progress, None, float]:
    """Evaluate ``tokens`` at the end of ``backend``'s context, a ``Progress`` per batch (see ``progress``);
    returns the seconds the evaluation took."""
    return (yield from progress(backend.eval_steps(tokens), label, stoppable=stoppable, above=above))


def to_the_end(steps: Generator[Progress, None, T]) -> Generator[Progress, None, T]:
    """``steps`` (evaluation that cannot stop halfway: a context rebuilt to a rollback point, whose tokens the
    transcript already says it holds), its ``Progress`` passed on; closed early, it first runs the rest
    without showing it, so what the context holds always matches the conversation."""
    # Not ``yield from``: closing it closes ``steps`` first, which would stop the evaluation halfway.
    while True:
        try:
            ev = next(steps)
        except StopIteration as stop:
            return cast(T, stop.value)
        try:
            yield ev
        except GeneratorExit:
            finish(steps)
            raise


def finish(steps: Generator[Progress, None, T]) -> T:
    """Run ``steps`` to their end without showing them and return their value: for a caller with no screen
    (``Conversation.undo`` is ``finish(undo_steps())``) or a path that cannot yield (cleanup)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return cast(T, stop.value)


@dataclass
class Drained(Generic[C]):
    """What ``drain`` saw: an opening's conversation and resume report (None for an operation), the replies'
    ends, the notices, and whether ``stop`` ended the events early."""

    conversation: C | None = None
    report: ResumeReport | None = None
    ends: list[ReplyEnd] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    stopped: bool = False


@overload
def drain(events: Opening[C], *, stop: Callable[[], bool] | None = None) -> Drained[C]: ...
@overload
def drain(events: Iterable[Event], *, stop: Callable[[], bool] | None = None) -> Drained[Any]: ...


def drain(events: Opening[Any] | Iterable[Event], *, stop: Callable[[], bool] | None = None) -> Drained[Any]:
    """Run ``events`` (an ``Opening``, or an operation such as ``Conversation.send``) to their end, keeping
    the reply ends and notices. ``stop`` is asked at each ``Progress``: True closes the events there (an
    opening releases its lock; a message being read is taken back out) and the result says ``stopped``."""
    out: Drained[Any] = Drained()
    for ev in events:
        if stop is not None and isinstance(ev, Progress) and stop():
            close: Any = getattr(events, "close", None)
            if close is not None:
                close()
            out.stopped = True
            return out
        if isinstance(ev, ReplyEnd):
            out.ends.append(ev)
        elif isinstance(ev, Notice):
            out.notices.append(ev)
    if isinstance(events, Opening):
        out.conversation, out.report = events.conversation, events.report
    return out


__all__ = ["Drained", "drain", "evaluate", "finish", "progress", "to_the_end"]
