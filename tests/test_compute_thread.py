"""ComputeThread's policy (no llama.cpp): calls run on its one thread, in order, results and errors come
back to the caller, a call made on the compute thread itself runs inline, and a KeyboardInterrupt while
waiting is raised only after the call has ended (the caller must not touch a context still decoding); rest
frees the OpenMP workers on the compute thread only when nothing is queued."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from chatcli.backends.compute import ComputeThread

pytestmark = pytest.mark.fast


def test_calls_from_many_threads_run_on_one_thread_in_order() -> None:
    c = ComputeThread()
    seen: list[tuple[int, int]] = []

    def record(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * 2

    results: dict[int, list[int]] = {}

    def caller(k: int) -> None:
        results[k] = [c.run(record, k * 100 + j) for j in range(20)]

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {ident for _, ident in seen} == {c._ident}
    assert c._ident != threading.get_ident()
    for k in range(4):
        assert results[k] == [(k * 100 + j) * 2 for j in range(20)]
        mine = [i for i, _ in seen if i // 100 == k]
        assert mine == sorted(mine)  # one caller's calls ran in its order


def test_errors_reach_the_caller_and_the_thread_goes_on() -> None:
    c = ComputeThread()

    def boom() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        c.run(boom)
    assert c.run(lambda: 7) == 7


def test_a_call_on_the_compute_thread_runs_inline() -> None:
    c = ComputeThread()
    assert c.run(lambda: c.run(threading.get_ident)) == c._ident  # would deadlock if it were queued


def test_ctrl_c_while_waiting_is_raised_after_the_call_ends() -> None:
    c = ComputeThread()
    ended: list[float] = []

    fired = threading.Event()

    def slow() -> str:
        # Ends only after the Ctrl-C was raised: a fixed sleep let a loaded machine (CI beside other work)
        # start the timer's thread after the call had returned, and nothing was raised.
        fired.wait(10.0)
        time.sleep(0.05)
        ended.append(time.monotonic())
        return "done"

    def ctrl_c() -> None:
        signal.raise_signal(signal.SIGINT)
        fired.set()

    # Python's own Ctrl-C handler, whatever the runner left: a shell without job control starts background
    # commands with SIGINT ignored, and Python then installs no handler (CI started with `&` failed here).
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.05, ctrl_c)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            c.run(slow)
        raised = time.monotonic()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert fired.is_set() and ended and raised >= ended[0]


def test_a_forked_child_starts_its_own_compute_thread() -> None:
    import os

    c = ComputeThread()
    assert c.run(lambda: 1) == 1
    pid = os.fork()
    if pid == 0:  # the child: the parent's compute thread did not survive the fork
        code = 0 if c.run(lambda: 41) + 1 == 42 else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_rest_frees_the_workers_on_the_compute_thread_unless_a_call_runs_or_is_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chatcli.backends import omp

    rested: list[int] = []
    monkeypatch.setattr(omp, "rest", lambda: rested.append(threading.get_ident()))
    c = ComputeThread()
    c.rest()
    assert rested == []  # nothing ran yet: no workers, and no thread started for nothing
    assert c._ident is None
    c.run(lambda: None)
    c.rest()
    assert rested == [c._ident]  # on the compute thread: OpenMP frees the calling thread's pool

    # A call queued behind a running one is another conversation's decode: its workers are needed now.
    running, release = threading.Event(), threading.Event()

    def busy() -> None:
        running.set()
        release.wait(10)

    first = threading.Thread(target=c.run, args=(busy,))
    first.start()
    assert running.wait(10)
    # A running call alone: another conversation's decode too, which a rest queued behind it would wait for
    # (the reply whose end called it sent its end a decode late).
    t0 = time.monotonic()
    c.rest()
    assert time.monotonic() - t0 < 5 and rested == [c._ident]
    # A borrower about to decode with its own pool waits for it, then frees the compute thread's workers.
    borrower = threading.Thread(target=lambda: c.rest(behind=True))
    borrower.start()
    borrower.join(0.2)
    assert borrower.is_alive() and rested == [c._ident]  # behind the running call
    second = threading.Thread(target=c.run, args=(lambda: None,))
    second.start()
    deadline = time.monotonic() + 10
    while c._jobs.qsize() < 2 and time.monotonic() < deadline:  # the borrower's rest, then this call
        time.sleep(0.001)
    assert c._jobs.qsize() == 2
    c.rest()  # returns at once: it does not wait behind the queue
    release.set()
    first.join()
    second.join()
    borrower.join(10)
    assert not borrower.is_alive() and rested == [c._ident] * 2  # the borrower's rest, once the call ended


def test_a_borrowing_thread_runs_its_own_calls_and_one_pool_lives_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """``borrowed``: the caller's calls run on the caller (no hop per token of a reply alone on its model);
    other threads' calls still go to the compute thread; the compute thread's OpenMP pool is freed before
    the loan and the borrower's after it (libgomp frees the calling thread's pool); nesting adds nothing."""
    from chatcli.backends import omp

    rested: list[int] = []
    monkeypatch.setattr(omp, "rest", lambda: rested.append(threading.get_ident()))
    c = ComputeThread()
    c.run(lambda: None)  # the compute thread exists, with its pool
    me = threading.get_ident()
    with c.borrowed():
        assert rested == [c._ident]
        assert c.run(threading.get_ident) == me
        other: list[int] = []
        t = threading.Thread(target=lambda: other.append(c.run(threading.get_ident)))
        t.start()
        t.join()
        assert other == [c._ident]
        with c.borrowed():
            assert c.run(threading.get_ident) == me
        assert rested == [c._ident]
    assert rested == [c._ident, me]
    assert c.run(threading.get_ident) == c._ident  # the loan is over

    def on_the_compute_thread() -> int:
        with c.borrowed():  # the compute thread borrows from itself: nothing to free, nothing to hand back
            return c.run(threading.get_ident)

    assert c.run(on_the_compute_thread) == c._ident and rested == [c._ident, me]
