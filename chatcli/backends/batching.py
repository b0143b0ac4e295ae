"""Gathering the next token of every conversation generating at once into one decode.

Pure thread coordination, no llama.cpp: the engine (backends/llamacpp.py) gives a ``run`` function that
decodes a list of requests in one ``llama_decode`` and returns one result per request. Each generating
thread calls ``submit`` with its next token and blocks; one of them (the leader) takes every request
pending at that moment and runs them together, the others wait for their result. The leader waits a
little for members that have joined but not yet submitted, so that N conversations in lock step share one
decode instead of taking turns; a slow consumer only misses a round, it never blocks one.

How little: ``gather`` (4 ms), or a quarter of a decode (``patience``) when that is longer. After a decode
the members come back one by one, each sampling under the GIL: measured with 8 clients on a busy 2-core
machine they came 1-18 ms after the decode ended, so 4 ms split a round of 8 into 6 and 2, and the 2
took a decode of their own (a decode of 2 costs about as much as one of 8 when decoding is memory-bound).
Waiting for a late member costs the others at most that quarter; not waiting costs them a whole decode.

The model may be busy with something else (a prompt being evaluated in a sibling's own context): the leader
takes the model's lock first and the batch only then, so every request that arrived while it waited goes
into that one decode. A batch taken before the lock split the round: those who came during the wait
missed it and decoded alone after the next prompt, a whole prompt's evaluation later.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ContextManager, Generic, TypeVar

Req = TypeVar("Req")
Res = TypeVar("Res")


@dataclass
class _Ticket(Generic[Req, Res]):
    request: Req
    done: bool = False
    result: Res | None = None
    error: BaseException | None = None


@dataclass
class BatchStats:
    """What the scheduler did (for tests and benchmarks)."""

    rounds: int = 0  # decodes run
    requests: int = 0  # requests decoded
    largest: int = 0  # most requests in one decode
    sizes: dict[int, int] = field(default_factory=dict)  # decode size -> how many


class BatchScheduler(Generic[Req, Res]):
    """Runs the requests of concurrent callers in shared batches, one batch at a time.

    ``join``/``leave`` bracket a caller's generation: the number of joined callers is how many requests a
    leader waits for (at most ``gather`` seconds after the first one arrived) before it runs the batch.

    Args:
        run: decodes a batch; returns one result per request, in order (an exception fails every request
            of that batch).
        gather: how long a leader waits for joined callers that have not submitted yet (default 4 ms) ...
        patience: ... or this fraction of a decode's duration (a running average), if longer (default 0.25).
        lock: the model's lock, held around ``run`` (taken before the batch is); ``run`` must not take it.
    """

    def __init__(self, run: Callable[[list[Req]], list[Res]], *, gather: float = 0.004, patience: float = 0.25,
                 lock: ContextManager[object] | None = None) -> None:
        self._run = run
        self.gather = gather
        self.patience = patience
        self._decode_seconds = 0.0  # running average of ``run``'s duration (0: none yet)
        self._lock: ContextManager[object] = lock if lock is not None else contextlib.nullcontext()
        self._cond = threading.Condition()
        self._pending: list[_Ticket[Req, Res]] = []
        self._first = 0.0  # when the oldest pending request arrived
        self._running = False
        self._active = 0
        self.stats = BatchStats()

    @property
    def active(self) -> int:
        """Callers between ``join`` and ``leave``."""
        return self._active

    def join(self) -> None:
        with self._cond:
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()  # a leader waiting for this caller's request need not wait any more

    def submit(self, request: Req) -> Res:
        """Decode ``request`` in the next batch; returns its result (or raises the batch's error)."""
        ticket: _Ticket[Req, Res] = _Ticket(request)
        with self._cond:
            if not self._pending:
                self._first = time.monotonic()
            self._pending.append(ticket)
            self._cond.notify_all()
        while True:
            with self._cond:
                while not ticket.done and not self._may_lead():
                    self._cond.wait(self._wait_time())
                if ticket.done:
                    break
                self._running = True  # this caller leads the next batch; the others wait for it
            self._lead(ticket)
        if ticket.error is not None:
            raise ticket.error
        return ticket.result  # type: ignore[return-value]  # set with done when no error

    def _may_lead(self) -> bool:
        if self._running or not self._pending:
            return False
        return len(self._pending) >= self._active or time.monotonic() - self._first >= self._window()

    def _window(self) -> float:
        """How long after the first pending request a leader waits for the other joined callers."""
        return max(self.gather, self.patience * self._decode_seconds)

    def _wait_time(self) -> float | None:
        if self._running or not self._pending:
            return None  # woken by the running batch's end or by a new request
        return max(0.0, self._window() - (time.monotonic() - self._first))

    def _lead(self, own: _Ticket[Req, Res]) -> None:
        results: list[Res] = []
        error: BaseException | None = None
        batch: list[_Ticket[Req, Res]] = []
        try:
            with self._lock:
                with self._cond:  # only now: the requests that came while the model was busy go in too
                    batch, self._pending = self._pending, []
                t0 = time.monotonic()
                results = self._run([t.request for t in batch])
                took = time.monotonic() - t0
                # A running average: one slow decode (a long wait for a core) does not set the window alone.
                self._decode_seconds = took if not self._decode_seconds else 0.75 * self._decode_seconds + 0.25 * took
            if len(results) != len(batch):
                error = RuntimeError(f"a batch of {len(batch)} gave {len(results)} results")
        except BaseException as exc:  # every caller of the batch gets it, the leader included
            error = exc
        if not batch and error is not None:  # interrupted waiting for the lock: nothing was taken or run
            with self._cond:
                # This caller raises: its request must not be decoded by a later batch behind its back.
                self._pending = [t for t in self._pending if t is not own]
                self._running = False
                self._cond.notify_all()
            raise error
        with self._cond:
            for i, t in enumerate(batch):
                if error is None:
                    t.result = results[i]
                else:
                    t.error = error
                t.done = True
            s = self.stats
            s.rounds += 1
            s.requests += len(batch)
            s.largest = max(s.largest, len(batch))
            s.sizes[len(batch)] = s.sizes.get(len(batch), 0) + 1
            self._running = False
            if self._pending:
                self._first = time.monotonic()  # those that came during this decode start a new round
            self._cond.notify_all()
