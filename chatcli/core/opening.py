"""Draining the create/open generators: the one place that tells their three kinds of items apart.

``Conversation.create`` and ``Conversation.open`` (and ``Session.new_conversation`` /
``open_conversation``) yield events (progress, notices), then open yields a ``ResumeReport``, and last
comes the conversation itself. Front ends render the events and keep the other two.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from chatcli.core.events import EVENT_TYPES, Event, ResumeReport

C = TypeVar("C")


@dataclass
class Opened(Generic[C]):
    """What a create/open generator produced besides events (filled in as its events are consumed)."""

    conversation: C | None = None
    report: ResumeReport | None = None


def split_opening(items: Iterable[Event | ResumeReport | C]) -> tuple[Iterator[Event], Opened[C]]:
    """The events of ``items``, and the box that receives its report and conversation.

    The box is complete once the returned iterator is exhausted. Anything that is neither an event nor a
    report is the conversation (the real one or a test double implementing its interface).
    """
    opened: Opened[C] = Opened()

    def events() -> Iterator[Event]:
        for item in items:
            if isinstance(item, ResumeReport):
                opened.report = item
            elif isinstance(item, EVENT_TYPES):
                yield item
            else:
                opened.conversation = item

    return events(), opened


__all__ = ["Opened", "split_opening"]
