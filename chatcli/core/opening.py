"""``Opening``: one conversation being created, opened or adopted, as one object.

Iterating an opening yields its progress events (``Progress``, ``Notice``); once they end, ``.conversation``
and ``.report`` (the ``ResumeReport`` of an open, None for a create) are there. Reading either before the
events ran drains them unseen, as llm's ``Response.text()`` forces a streamed response. Stopping early
(``close()``, or dropping the opening) releases the conversation's lock: nothing stays half-open.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Generic, TypeVar

from chatcli.core.events import ConversationError, Event, ResumeReport

C = TypeVar("C")

Steps = Generator[Event, None, tuple[C, ResumeReport | None]]
"""What an opening runs: yields events, returns (the conversation, its resume report or None)."""


class Opening(Generic[C]):
    """A create/open in flight (see the module docstring). Single use: its events run once."""

    def __init__(self, steps: Steps[C]) -> None:
        self._steps = steps
        self._events = self._run()
        self._conversation: C | None = None
        self._report: ResumeReport | None = None
        self._done = False

    @classmethod
    def ready(cls, conversation: C, report: ResumeReport | None = None, events: Iterable[Event] = ()) -> Opening[C]:
        """An opening whose conversation is already there (after ``events``): for adopted conversations and
        test doubles."""
        def steps() -> Steps[C]:
            yield from events
            return conversation, report

        return cls(steps())

    def _run(self) -> Generator[Event, None, None]:
        conversation, report = yield from self._steps
        self._conversation, self._report, self._done = conversation, report, True

    def __iter__(self) -> Iterator[Event]:
        return self._events

    def then(self, after: Callable[[C], Iterable[Event]]) -> Opening[C]:
        """This opening followed by ``after(conversation)``'s events (e.g. the session's state budget)."""
        first = self._steps

        def steps() -> Steps[C]:
            conversation, report = yield from first
            yield from after(conversation)
            return conversation, report

        return Opening(steps())

    def before(self, events: Iterable[Event]) -> Opening[C]:
        """``events`` (e.g. notes of the resume policy), then this opening."""
        rest = self._steps

        def steps() -> Steps[C]:
            yield from events
            return (yield from rest)

        return Opening(steps())

    def _finish(self) -> None:
        for _ in self._events:
            pass

    @property
    def conversation(self) -> C:
        if not self._done:
            self._finish()
        if self._conversation is None:  # its events were stopped before the end
            raise ConversationError("the conversation could not be opened")
        return self._conversation

    @property
    def report(self) -> ResumeReport | None:
        if not self._done:
            self._finish()
        return self._report

    def close(self) -> None:
        """Stop before the end: the conversation's lock is released (a no-op once it is open)."""
        self._events.close()
        self._steps.close()


__all__ = ["Opening", "Steps"]
