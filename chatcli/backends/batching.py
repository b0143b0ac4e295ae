"""Gathering the next token of every conversation generating at once into one decode.

Pure thread coordination, no llama.cpp: the engine (backends/llamacpp.py) gives a ``run`` function that
decodes a list of requests in one ``llama_decode`` and returns one result per request. Each generating
thread calls ``submit`` with its next token and blocks; one of them (the leader) takes every request
pending at that moment and runs them together, the others wait for their result. The leader waits a
little for members that have joined but not yet submitted, so that N conversations in lock step share one
decode instead of taking turns; a slow consumer only misses a round, it never blocks one.

Requests need not be one token each: a prompt's chunk goes into the same decode as the others' next tokens
(llama-server's update_slots does the same), so each request has a ``size`` and one run takes, oldest first,
as many as fit in ``limit``; the rest lead the next run. A prompt's request (``gathers_returning``) also
waits for callers that ended a generation less than ``linger`` seconds ago (``leave(linger=True)``): clients
in lock step send their next messages within milliseconds of each other, and two prompts that share one
decode cost about one prompt's time, where the one that went first alone put the other a whole prompt
behind. Each such entry carries its caller's key (its sequence) and only that caller's ``join`` takes it:
taken by whoever joined first, a sibling's message ran alone while the caller it was waiting for came
back with its first token a millisecond later, and that token took a decode of its own. A round of next
tokens waits for a caller that is not generating only when its first token is due: its message was just
evaluated in the batch (``leave(follows=True)``), and for at most three windows; without that, each
message batched cost one more decode (the siblings' tokens went alone while it saved and sampled).

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
_BUSY = 0.001  # a wait for the model's lock longer than this: it was decoding for someone else
Res = TypeVar("Res")


@dataclass
class _Ticket(Generic[Req, Res]):
    request: Req
    size: int = 1
    gathers_returning: bool = False
    done: bool = False
    result: Res | None = None
    error: BaseException | None = None


@dataclass
class _Expected:
    """A caller expected back: ``key`` (its sequence), waited for by a prompt's round until ``until``, by
    every round until ``tokens_until``."""

    key: object
    until: float
    tokens_until: float


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
        size: a request's size (default 1 each) ...
        limit: ... and the most one run takes (None: no limit); a request larger than it runs alone.
        linger: how long a caller that left with ``linger=True`` is waited for by a prompt (default 0).
    """

    def __init__(self, run: Callable[[list[Req]], list[Res]], *, gather: float = 0.004, patience: float = 0.25,
                 lock: ContextManager[object] | None = None, size: Callable[[Req], int] | None = None,
                 limit: int | None = None, linger: float = 0.0) -> None:
        self._run = run
        self._size = size
        self.limit = limit
        self.linger = linger
        self._returning: list[_Expected] = []  # callers expected back (left lingering, or their reply follows)
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

    @property
    def busy(self) -> bool:
        """Whether a run is going on or requests wait for one."""
        with self._cond:
            return self._running or bool(self._pending)

    def returning(self) -> int:
        """Callers expected back (left lingering less than ``linger`` seconds ago, or with ``follows``) that
        have not joined since."""
        with self._cond:
            return self._count_returning()

    def _count_returning(self, *, tokens: bool = False) -> int:
        """Callers expected back now: by a prompt's round, or (``tokens``) by every round."""
        now = time.monotonic()
        self._returning = [e for e in self._returning if e.until > now]
        if tokens:
            return sum(1 for e in self._returning if e.tokens_until > now)
        return len(self._returning)

    def join(self, key: object = None) -> None:
        """A caller starts a generation or an evaluation. ``key`` names it (its sequence): its own entry as
        a caller expected back is taken out, nobody else's (without a key, the oldest entry without one)."""
        with self._cond:
            self._active += 1
            self._count_returning()
            for i, e in enumerate(self._returning):
                if e.key == key:
                    del self._returning[i]
                    break

    def leave(self, *, linger: bool = False, key: object = None, follows: bool = False) -> None:
        """``linger``: the caller is likely to come back with a prompt soon (it ended a reply). ``follows``:
        it comes back at once with its reply's first token (its message was just evaluated): every round
        waits for it then, not only a prompt's, for up to three gather windows (it copies its cells back,
        the state log saves them, it samples); and a prompt's round, as for ``linger``, after that."""
        with self._cond:
            self._active -= 1
            now = time.monotonic()
            if follows:
                soon = now + 3 * self._window()
                self._returning.append(_Expected(key, max(soon, now + self.linger), soon))
            elif linger and self.linger > 0:
                self._returning.append(_Expected(key, now + self.linger, now))
            self._cond.notify_all()  # a leader waiting for this caller's request need not wait any more

    def submit(self, request: Req, *, gathers_returning: bool = False) -> Res:
        """Decode ``request`` in the next batch; returns its result (or raises the batch's error).
        ``gathers_returning``: the batch also waits for callers that left lingering (a prompt's request)."""
        size = self._size(request) if self._size is not None else 1
        ticket: _Ticket[Req, Res] = _Ticket(request, size, gathers_returning)
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
        return len(self._pending) >= self._expected() or time.monotonic() >= self._deadline()

    def _expected(self) -> int:
        """How many requests the next run waits for: one per joined caller, one per caller whose first token
        follows, and for a prompt's sake one per caller expected back."""
        prompt = any(t.gathers_returning for t in self._pending)
        return self._active + self._count_returning(tokens=not prompt)

    def _deadline(self) -> float:
        """When the leader stops waiting: a gather window after the first pending request, or later for a
        caller whose first token follows (its message was evaluated; it samples, then submits)."""
        return max([self._first + self._window(), *(e.tokens_until for e in self._returning)])

    def _window(self) -> float:
        """How long after the first pending request a leader waits for the other joined callers."""
        return max(self.gather, self.patience * self._decode_seconds)

    def _wait_time(self) -> float | None:
        if self._running or not self._pending:
            return None  # woken by the running batch's end or by a new request
        return max(0.0, self._deadline() - time.monotonic())

    def _regather(self) -> None:
        """The model was busy (a sibling's message evaluated alone): its owner's first token comes right
        after, so wait for the joined callers again, up to a window, before taking the batch. Not holding
        the model's lock: that token's conversation takes it to enter the batch context. Without this the
        message queued behind the busy model went alone, and that first token decoded alone after it."""
        # Three windows: that conversation samples, then copies itself into the batch context (measured: its
        # token came 3 ms after one window, a whole 0.7 s prompt late, on a busy machine).
        deadline = time.monotonic() + 3 * self._window()
        while len(self._pending) < self._expected():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)

    def _take(self) -> list[_Ticket[Req, Res]]:
        """The oldest pending requests that fit in ``limit`` together (at least one); the rest stay pending."""
        if self.limit is None:
            return list(self._pending)
        taken: list[_Ticket[Req, Res]] = []
        total = 0
        for t in self._pending:
            if taken and total + t.size > self.limit:
                break  # in order: a large request is not overtaken again and again by small ones
            taken.append(t)
            total += t.size
        return taken

    def _lead(self, own: _Ticket[Req, Res]) -> None:
        results: list[Res] = []
        error: BaseException | None = None
        batch: list[_Ticket[Req, Res]] = []
        try:
            t_lock = time.monotonic()
            with self._lock:
                busy = time.monotonic() - t_lock > _BUSY
            if busy:
                with self._cond:
                    self._regather()
            with self._lock:
                with self._cond:  # only now: the requests that came while the model was busy go in too
                    batch = self._take()
                    self._pending = self._pending[len(batch):]  # what did not fit leads the next run
                t0 = time.monotonic()
                results = self._run([t.request for t in batch])
                took = time.monotonic() - t0
                # A running average: one slow decode (a long wait for a core) does not set the window alone.
                # Of rounds of single requests (next tokens) only: the window is a quarter of such a round, not
                # of one carrying a prompt.
                if all(t.size == 1 for t in batch):
                    self._decode_seconds = (took if not self._decode_seconds
                                            else 0.75 * self._decode_seconds + 0.25 * took)
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
