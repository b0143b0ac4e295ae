"""Every ``llama_decode`` of the process runs on one thread.

llama.cpp's CPU backend (built with OpenMP, the default) starts a ``#pragma omp parallel`` team per graph,
and its threads meet at ``#pragma omp barrier`` hundreds of times per token. libgomp keeps a pool of worker
threads per *calling* thread: a second thread that decodes gets a pool of its own, and the first thread's
pool lives on until that thread exits. Once the workers of all pools outnumber the CPUs, libgomp spins
100 times instead of 300,000 at every barrier (``gomp_throttled_spin_count_var``, libgomp/env.c) and sleeps
in the kernel: every decode of the process then runs as with ``OMP_WAIT_POLICY=PASSIVE``, which costs 2.7×
on an idle machine (bench/results/decode.md). ``serve`` decodes on the request threads, so with two clients
(or a batch led by whichever thread got there first) it ran in that regime; measured on one context,
alternating two Python threads between single-token decodes ran at 41–58 tokens/s against 79–106 from one.

llama-server decodes on one thread; so does chatcli now: ``run`` hands the call to the compute thread and
waits, unless the caller is that thread. A hop costs two futex wake-ups, microseconds against a decode's
milliseconds, most of the time: between two decodes the pool's worker spins on a core, and the caller woken
after a decode sometimes waits behind it for a scheduler slice (hops of ~3 ms, about twice per 48-token reply
of ``serve``, ``bench/serve_timeline.py``). So a reply generated alone on its model (no sibling context that
could decode meanwhile: ``talk``, ``serve --parallel 1``) borrows the decoding for its thread (``borrowed``):
the compute thread's pool is freed first and the caller's when the reply ends, so one pool lives at a time,
and the reply's tokens are decoded with no hop at all.

When a reply ends, ``rest`` lets the thread's OpenMP workers go instead of spinning on a core for ~10 ms
(``omp``), unless another decode is already waiting.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from chatcli.backends import omp

T = TypeVar("T")


class _Job:
    __slots__ = ("args", "done", "error", "finished", "fn", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.done = _thread.allocate_lock()  # held until the compute thread has run the call
        self.done.acquire()
        self.finished = False  # set before ``done`` is released: the truth when a wait was interrupted
        self.result: Any = None
        self.error: BaseException | None = None


class ComputeThread:
    """One daemon thread running the calls handed to it, one at a time, in order."""

    def __init__(self, name: str = "chatcli-compute") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._ident: int | None = None
        self._borrower: int | None = None  # the thread decoding itself now (``borrowed``), if any
        self._busy = False  # a call is running on the compute thread now
        # A forked child has no compute thread (only the forking thread survives a fork): it starts its own.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._ident = None
        self._borrower = None
        self._busy = False

    def _ensure(self) -> None:
        if self._ident is not None:
            return
        with self._start_lock:
            if self._ident is None:
                t = threading.Thread(target=self._loop, name=self._name, daemon=True)
                t.start()
                self._ident = t.ident

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            self._busy = True
            try:
                job.result = job.fn(*job.args)
            except BaseException as exc:  # the caller raises it
                job.error = exc
            self._busy = False
            job.finished = True
            job.done.release()

    def rest(self, *, behind: bool = False) -> None:
        """Free the compute thread's OpenMP workers, unless a call runs or is queued (another conversation's
        decode: its workers are needed now, and waiting behind it held a reply's end back by that decode,
        13-25 ms at ``serve --parallel 2``: bench/serve_timeline.py). Waits for it: queued behind, the compute
        thread would need the GIL back from a caller busy with the reply's aftermath while the workers spin.
        ``behind``: a running call is waited for, then the workers freed (``borrowed``: one pool at a time)."""
        if self._ident is None:
            return  # nothing decoded yet: no workers
        if (behind or not self._busy) and self._jobs.empty():
            self.run(omp.rest)

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[None]:
        """Until the block ends, ``run`` called from this thread runs the call here, as on the compute thread.

        For a caller that alone decodes on its model for a while (a reply with no sibling context): the
        compute thread's OpenMP pool is freed first and this thread's when the block ends, so the process
        keeps one pool at a time (more pools than CPUs throttle every barrier: the module docstring). Calls
        from other threads still go to the compute thread. Nested, or on the compute thread: nothing more."""
        me = threading.get_ident()
        if me in (self._ident, self._borrower):
            yield
            return
        self.rest(behind=True)
        before, self._borrower = self._borrower, me
        try:
            yield
        finally:
            self._borrower = before
            omp.rest()  # this thread's workers, before the compute thread's pool comes back

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the compute thread (or on a thread that ``borrowed`` it); its result, or its
        exception raised here."""
        me = threading.get_ident()
        if me == self._ident or me == self._borrower:
            return fn(*args)
        self._ensure()
        job = _Job(fn, args)
        self._jobs.put(job)
        interrupted: BaseException | None = None
        while True:
            # The call runs on whatever happens here: a Ctrl-C (KeyboardInterrupt from the signal handler)
            # must not let the caller touch the context while the compute thread still decodes into it, so
            # it is raised once the call has ended, as it was when the decode ran on the caller's thread.
            # A KeyboardInterrupt may also come just after ``acquire`` returned: ``finished`` says whether
            # there is anything left to wait for.
            try:
                job.done.acquire()
                break
            except BaseException as exc:
                interrupted = exc
                if job.finished:
                    break
        if interrupted is not None:
            raise interrupted
        if job.error is not None:
            raise job.error
        result: T = job.result
        return result


COMPUTE = ComputeThread()
"""The process's compute thread: every llama_decode goes through it."""
