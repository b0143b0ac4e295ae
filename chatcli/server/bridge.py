"""One service call in a worker thread, its events handed to the event loop in batches.

The service blocks on the model, so each request runs it in a thread of its own; the event loop reads its
events. The hand-off is the per-token cost that remains once decoding is as fast as llama.cpp's: every
``call_soon_threadsafe`` writes the loop's self-pipe and wakes its thread, which then takes the GIL and the
cores from the decode threads. So the worker appends to a deque and wakes the loop only when no wake-up is
pending; the consumer takes every event waiting in one go (``take``), and a reader slower than the model
gets several tokens per wake-up instead of one wake-up per token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Iterator

from chatcli.errors import ChatcliError
from chatcli.server.service import ChatRequest, ChatService

log = logging.getLogger("chatcli.server")

END = object()  # the last item of every run: the worker is done (its iterator closed, the reply recorded)


class Run:
    """One service call in a worker thread; ``take`` gives its events (``END`` last) on the event loop."""

    def __init__(self, service: ChatService, req: ChatRequest, running: set[Run]) -> None:
        self.running = running
        running.add(self)
        self.loop = asyncio.get_running_loop()
        self.cancel = threading.Event()
        self._items: collections.deque[object] = collections.deque()
        self._woken = False  # a wake-up is scheduled and has not run yet (set by the worker, cleared by the loop)
        self._waiter: asyncio.Future[None] | None = None
        self._taken: collections.deque[object] = collections.deque()  # taken by ``next``, not yet returned
        self.thread = threading.Thread(target=self._work, args=(service.complete(req, cancelled=self.cancel.is_set),),
                                       daemon=True)
        self.thread.start()

    # -- the worker thread ------------------------------------------------------------------------------------

    def _put(self, item: object) -> None:
        # Append first, then look at the flag: a wake-up seen pending runs after this append (the loop
        # clears the flag before it wakes the consumer, and the consumer empties the deque after that).
        self._items.append(item)
        if self._woken:
            return
        self._woken = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            # The server is shutting down (its event loop closed): nobody listens any more, and closing
            # the service iterator below still records the reply.
            self.cancel.set()

    def _work(self, it: Iterator[object]) -> None:
        try:
            for ev in it:
                self._put(ev)
                if self.cancel.is_set():
                    break  # the client left: closing the iterator records the reply so far
        except ChatcliError as exc:
            self._put(exc)
        except Exception as exc:  # never a traceback to the client; the log has it
            log.exception("request failed")
            self._put(ChatcliError(f"internal error ({type(exc).__name__})", kind="engine"))
        finally:
            try:
                close = getattr(it, "close", None)
                if close is not None:
                    close()  # records a reply cut short: may fail (disk full), the end must still be sent
            except Exception:
                log.exception("recording the end of a request failed")
            finally:
                self.running.discard(self)
                self._put(END)

    # -- the event loop ---------------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._woken = False
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self, timeout: float | None = None) -> list[object]:
        """Every event waiting, in order, after waiting for at least one; ``[]`` when ``timeout`` seconds
        passed without any (the caller's chance to send a keep-alive)."""
        if self._taken:  # left over by ``next``
            left = list(self._taken)
            self._taken.clear()
            return left
        items = self._items
        if not items:
            self._waiter = waiter = self.loop.create_future()
            timer = self.loop.call_later(timeout, _settle, waiter) if timeout is not None else None
            try:
                if not items:  # an event that came in since the check above woke nobody: not waited for
                    await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        out: list[object] = []
        while items:
            out.append(items.popleft())
        return out

    async def next(self) -> object:
        """The next event (the first and the non-streamed ones are read one at a time)."""
        while not self._taken:
            self._taken.extend(await self.take())
        return self._taken.popleft()


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
