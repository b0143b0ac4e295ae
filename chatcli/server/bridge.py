"""One service call in a worker thread, its events handed to the event loop in batches.

The service blocks on the model, so each request runs it in a thread of its own; the event loop reads its
events. That hand-off is the per-token cost left once decoding runs at llama.cpp's speed (issue #22): each
``call_soon_threadsafe`` writes the loop's self-pipe and wakes its thread, which takes the GIL and a core
from the decode threads at a moment of nobody's choosing. So:

- the worker appends to a deque and wakes the loop only when the consumer waits and no wake-up is pending;
- the consumer takes every event waiting in one go (``take``), and a streamed reply's text is batched:
  after sending, the stream waits ``window`` seconds (50 ms: text still comes 20 times a second) for more
  tokens unless something other than text arrives (the end, an error), which wakes it at once. The first
  token goes out as soon as it is sampled; at 75 tokens/s a wake-up carries ~4 tokens instead of one.
  Measured (the section-1 work of bench/decode.py, the decodes timed inside the server, alternating with
  the Engine in its own process, three runs): with 20 ms each ``llama_decode`` of a streamed reply took
  1.8-3.3 % longer than the Engine's (12.91 vs 12.51 ms), with 50 ms 0-1.1 % (12.64); the client's decode
  rate was 0.963-0.979 of the Engine's with 20 ms, 0.974-0.992 with 50 ms (100 ms: no better than 50).

Ordering argument (no lock; every step below is one bytecode-level operation under the GIL): the worker
appends, *then* reads ``_waiter``; the consumer sets ``_waiter``, *then* looks at the deque. Either the
worker sees the waiter (and wakes it), or its append came before the consumer's look (which sees it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Iterator

from chatcli.errors import ChatcliError
from chatcli.server.service import ChatRequest, ChatService, Delta

log = logging.getLogger("chatcli.server")

END = object()  # the last item of every run: the worker is done (its iterator closed, the reply recorded)
WINDOW = 0.05  # seconds a stream waits for more text after sending some (see the module docstring)


class Run:
    """One service call in a worker thread; ``take`` gives its events (``END`` last) on the event loop."""

    def __init__(self, service: ChatService, req: ChatRequest, running: set[Run]) -> None:
        self.running = running
        running.add(self)
        self.loop = asyncio.get_running_loop()
        self.cancel = threading.Event()
        self._items: collections.deque[object] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None  # the consumer waits on it (set on the loop only)
        self._text_waits = False  # the consumer batches text: only other events wake it
        self._woken = False  # a wake-up is scheduled and has not run yet (set by the worker, cleared by the loop)
        self._taken: collections.deque[object] = collections.deque()  # taken by ``next``, not yet returned
        self.wakeups = 0  # wake-ups the worker asked for (the tests and the bench look)
        self.thread = threading.Thread(target=self._work, args=(service.complete(req, cancelled=self.cancel.is_set),),
                                       daemon=True)
        self.thread.start()

    # -- the worker thread ------------------------------------------------------------------------------------

    def _put(self, item: object) -> None:
        self._items.append(item)
        if self._waiter is None or self._woken or (self._text_waits and type(item) is Delta):
            return  # the consumer is busy (it empties the deque next), already woken, or batching text
        self._woken = True
        self.wakeups += 1
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
        _settle(self._waiter)

    async def _wait(self, seconds: float | None, *, text_waits: bool) -> None:
        """Wait until woken or ``seconds`` passed, unless what the wait is for is there already."""
        self._text_waits = text_waits
        self._waiter = waiter = self.loop.create_future()
        try:
            items = self._items
            if items and not (text_waits and all(type(x) is Delta for x in items)):
                return
            timer = self.loop.call_later(seconds, _settle, waiter) if seconds is not None else None
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
        finally:
            self._waiter = None
            self._text_waits = False

    async def take(self, timeout: float | None = None, *, window: float = 0.0) -> list[object]:
        """Every event waiting, in order, after waiting for at least one; ``[]`` when ``timeout`` seconds
        passed without any (the caller's chance to send a keep-alive). With ``window``, first wait that
        long for text to gather (anything else ends the wait at once)."""
        if self._taken:  # left over by ``next``
            left = list(self._taken)
            self._taken.clear()
            return left
        if window > 0:
            await self._wait(window, text_waits=True)
        if not self._items:
            await self._wait(timeout, text_waits=False)
        out: list[object] = []
        items = self._items
        while items:
            out.append(items.popleft())
        return out

    async def next(self) -> object:
        """The next event (a request's first is read alone; the rest are taken in batches, ``take``)."""
        while not self._taken:
            self._taken.extend(await self.take())
        return self._taken.popleft()


def _settle(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
