"""A SIGTERM that arrives before uvicorn takes the signals over stops ``serve`` cleanly.

Without a handler, a SIGTERM in the first ~0.3 s (typer's import, the HTTP layer's, the model load) kills
the process with status 143 and nothing said. ``install`` is called by the entry point as soon as it sees
``serve``; the handler only records the request, and ``on_stop`` hands it to the server once it exists, so
the stop goes through the same path as a SIGTERM while serving (recorded replies, exit 0). uvicorn saves
and restores this handler around its run, so a SIGTERM during the final close is recorded here too.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

_requested = False
_callback: Callable[[], None] | None = None


_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


def install() -> _Handler:
    """Record SIGTERM from now on (main thread only: elsewhere Python cannot install handlers); returns
    the handler it replaced, for ``restore``."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _handler)


def restore(previous: _Handler) -> None:
    """Put ``previous`` back (a server run inside another program leaves its handler as it was) and forget
    the callback; a SIGTERM recorded meanwhile is passed on to that handler, as uvicorn does."""
    global _callback, _requested
    _callback = None
    if previous is None or previous is _handler or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, previous)
    if _requested:
        _requested = False
        signal.raise_signal(signal.SIGTERM)


def _handler(sig: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True
    if _callback is not None:
        _callback()


def requested() -> bool:
    """Whether a SIGTERM came while this module's handler was installed."""
    return _requested


def on_stop(callback: Callable[[], None]) -> None:
    """Run ``callback`` at the next recorded SIGTERM, or now if one came already."""
    global _callback
    _callback = callback
    if _requested:
        callback()
