"""The batch scheduler's policy, without a model: concurrent submissions share one run, one run at a time,
a caller that does not submit only delays a round by the gather window, errors reach every caller."""

from __future__ import annotations

import threading
import time

import pytest

from chatcli.backends.batching import BatchScheduler

pytestmark = pytest.mark.fast


class Recorder:
    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.inside = 0
        self.most = 0
        self.delay = delay
        self.guard = threading.Lock()

    def __call__(self, reqs: list[int]) -> list[int]:
        with self.guard:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(self.delay)
        with self.guard:
            self.inside -= 1
            self.batches.append(list(reqs))
        return [r * 10 for r in reqs]


def lockstep(sched: BatchScheduler[int, int], n: int, steps: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {i: [] for i in range(n)}
    start = threading.Barrier(n)

    def member(i: int) -> None:
        sched.join()
        try:
            start.wait()
            for s in range(steps):
                out[i].append(sched.submit(i * 100 + s))
        finally:
            sched.leave()

    th = [threading.Thread(target=member, args=(i,)) for i in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return out


def test_members_in_lock_step_share_every_run() -> None:
    run = Recorder(delay=0.002)
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.5)  # long: waiting for all is the policy
    out = lockstep(sched, 4, 10)
    assert all(out[i] == [(i * 100 + s) * 10 for s in range(10)] for i in range(4))  # each gets its own result
    assert run.most == 1  # one run at a time
    assert [len(b) for b in run.batches] == [4] * 10
    assert sched.stats.rounds == 10 and sched.stats.largest == 4


def test_a_joined_member_that_does_not_submit_delays_a_round_by_the_gather_time_only() -> None:
    run = Recorder()
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.05)
    sched.join()  # joined, never submits (a client reading slowly)
    sched.join()
    t0 = time.monotonic()
    assert sched.submit(3) == 30
    took = time.monotonic() - t0
    assert 0.04 <= took < 1.0
    sched.leave()
    sched.leave()
    assert run.batches == [[3]]


def test_leaving_releases_a_waiting_leader_at_once() -> None:
    run = Recorder()
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=5.0)
    sched.join()
    sched.join()
    threading.Timer(0.05, sched.leave).start()
    t0 = time.monotonic()
    assert sched.submit(1) == 10
    assert time.monotonic() - t0 < 2.0
    sched.leave()


def test_an_error_in_a_run_reaches_every_caller_of_that_batch() -> None:
    def failing(reqs: list[int]) -> list[int]:
        raise RuntimeError("decode failed")

    sched: BatchScheduler[int, int] = BatchScheduler(failing, gather=0.5)
    errors: list[str] = []
    start = threading.Barrier(2)

    def member(i: int) -> None:
        sched.join()
        start.wait()
        try:
            sched.submit(i)
        except RuntimeError as exc:
            errors.append(str(exc))
        finally:
            sched.leave()

    th = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert errors == ["decode failed", "decode failed"]
    assert sched.stats.largest == 2


def test_requests_that_come_while_the_model_is_busy_join_the_leaders_batch() -> None:
    # A sibling evaluates its prompt (holds the model's lock): the first step's caller becomes the leader,
    # the others come meanwhile. All three go into one decode once the model is free, not 1 then 2.
    model = threading.Lock()
    run = Recorder()
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.0, lock=model)  # no gathering: the lock does it
    out: dict[int, int] = {}

    def member(i: int) -> None:
        out[i] = sched.submit(i)

    for _ in range(3):
        sched.join()
    model.acquire()  # the prompt
    th = [threading.Thread(target=member, args=(i,)) for i in range(3)]
    th[0].start()
    time.sleep(0.05)  # the leader now waits for the model
    th[1].start()
    th[2].start()
    time.sleep(0.05)
    assert run.batches == []
    model.release()
    for t in th:
        t.join()
    assert out == {0: 0, 1: 10, 2: 20}
    assert run.batches == [[0, 1, 2]]
    for _ in range(3):
        sched.leave()


def test_a_leader_interrupted_waiting_for_the_model_takes_its_request_back() -> None:
    class Interrupting:
        """A lock whose acquisition is interrupted (a KeyboardInterrupt while waiting for the model)."""

        def __enter__(self) -> None:
            raise KeyboardInterrupt

        def __exit__(self, *exc: object) -> None:
            pass

    run = Recorder()
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.0, lock=Interrupting())
    with pytest.raises(KeyboardInterrupt):
        sched.submit(1)
    sched._lock = threading.Lock()  # the model is free again: the next request runs alone
    assert sched.submit(2) == 20
    assert run.batches == [[2]]  # the interrupted request was never decoded


def late_member(patience: float) -> list[int]:
    """Two members; one submits 20 ms after it got its result (sampling slowly), the decode takes 0.4 s."""
    run = Recorder(delay=0.4)
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.004, patience=patience)
    start = threading.Barrier(2)

    def member(i: int, lag: float) -> None:
        sched.join()
        try:
            start.wait()
            for s in range(5):
                time.sleep(lag)
                sched.submit(i * 100 + s)
        finally:
            sched.leave()

    th = [threading.Thread(target=member, args=(0, 0.0)), threading.Thread(target=member, args=(1, 0.02))]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return [len(b) for b in run.batches]


def test_a_member_late_by_less_than_a_quarter_decode_is_waited_for() -> None:
    # The first round has no decode to measure yet (the 4 ms gather: the late member misses it, and so
    # its last step is alone too); from then on the window is 0.1 s and every round holds both members.
    sizes = late_member(0.25)
    assert sizes == [1, 2, 2, 2, 2, 1]
    # Without patience the late member misses round after round (the same policy as before: 4 ms).
    assert len(late_member(0.0)) >= 7  # 1, 2, 1, 2, ...: every other round split


def test_requests_of_several_tokens_share_a_run_up_to_its_limit_oldest_first() -> None:
    # A prompt's chunk goes into the decode of the others' next tokens; what does not fit leads the next run.
    model = threading.Lock()
    run = Recorder()
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.0, lock=model, size=lambda r: r, limit=10)
    out: dict[int, int] = {}
    model.acquire()  # busy: every request below is pending when the model is free
    th = []
    for r in (6, 1, 4, 1):  # 6 + 1 fit in 10; 4 would not, so it and the 1 behind it wait for the next run
        th.append(threading.Thread(target=lambda r=r: out.__setitem__(r, sched.submit(r))))
        th[-1].start()
        time.sleep(0.03)
    model.release()
    for t in th:
        t.join()
    assert run.batches == [[6, 1], [4, 1]]
    assert out == {6: 60, 1: 10, 4: 40}


def test_a_message_waits_for_a_caller_that_just_ended_a_reply_and_a_token_does_not() -> None:
    run = Recorder()
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.3, linger=5.0)
    for _ in range(3):  # three replies, generating together ...
        sched.join()
    for _ in range(3):  # ... ended: their clients' next messages are likely to follow
        sched.leave(linger=True)
    assert sched.returning() == 3
    sched.join()  # one of them is back, generating
    t0 = time.monotonic()
    assert sched.submit(1) == 10  # a generated token does not wait for those expected back
    assert time.monotonic() - t0 < 0.2 and run.batches == [[1]]
    sched.leave()
    out: dict[int, int] = {}

    def message(r: int) -> None:
        sched.join()  # each message's caller is joined while it evaluates (it is one of those expected back)
        try:
            out[r] = sched.submit(r, gathers_returning=True)
        finally:
            sched.leave()

    a = threading.Thread(target=message, args=(2,))
    a.start()
    time.sleep(0.05)  # within the gather window: the first message waits for the other one expected back
    b = threading.Thread(target=message, args=(3,))
    b.start()
    a.join()
    b.join()
    assert out == {2: 20, 3: 30}
    assert run.batches == [[1], [2, 3]]  # the two messages in one run


def test_after_waiting_for_a_busy_model_the_leader_gathers_the_members_again() -> None:
    # A sibling's message is evaluated alone (the model's lock); a message that came meanwhile is pending.
    # The sibling's first token comes just after it: both go into one run, not the message alone first.
    model = threading.Lock()
    run = Recorder()
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.05, lock=model)
    out: dict[int, int] = {}
    model.acquire()
    sched.join()  # the message's caller
    b = threading.Thread(target=lambda: out.__setitem__(2, sched.submit(2)))
    b.start()
    time.sleep(0.1)  # past the gather window: it leads, waiting for the model
    sched.join()  # the evaluating sibling starts its reply
    model.release()
    time.sleep(0.02)  # sampling its first token
    assert out.get(2) is None
    assert sched.submit(1) == 10
    b.join()
    sched.leave()
    sched.leave()
    assert run.batches == [[2, 1]]


def test_a_caller_expected_back_is_taken_off_by_its_own_return_only() -> None:
    # Two replies ended (keys 0 and 1): both are expected back. A third caller's join takes neither entry;
    # caller 0's join takes its own, and caller 1 is still expected.
    sched: BatchScheduler[int, int] = BatchScheduler(Recorder(), linger=5.0)
    for key in (0, 1):
        sched.join(key)
        sched.leave(linger=True, key=key)
    sched.join(2)
    assert sched.returning() == 2
    sched.leave(key=2)
    sched.join(0)
    assert sched.returning() == 1
    sched.leave(key=0)


def test_a_message_waits_for_the_sibling_evaluating_alone_not_for_whoever_joined_first() -> None:
    # Sibling 0 evaluates its message alone, expected back (its first token follows). Sibling 1's message
    # comes meanwhile: its join must not take sibling 0's entry, so its message waits for sibling 0's first
    # token and both go into one run (before, the message ran alone and the token a decode later).
    run = Recorder()
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=0.3, linger=5.0)
    sched.join(0)
    sched.leave(linger=True, key=0)  # evaluating alone: not counted by rounds of tokens, a message waits
    out: dict[int, int] = {}

    def message() -> None:
        sched.join(1)
        try:
            out[1] = sched.submit(1, gathers_returning=True)
        finally:
            sched.leave(key=1, follows=True)

    th = threading.Thread(target=message)
    th.start()
    time.sleep(0.05)  # within the window: sibling 0's evaluation ends, its reply starts
    sched.join(0)
    out[0] = sched.submit(0)
    th.join()
    sched.leave(key=0)
    assert run.batches == [[1, 0]] and out == {1: 10, 0: 0}


def test_a_round_of_tokens_waits_for_a_caller_whose_message_was_just_evaluated() -> None:
    run = Recorder()
    window = 0.04
    sched: BatchScheduler[int, int] = BatchScheduler(run, gather=window, linger=5.0)
    sched.join(0)  # generating
    sched.join(1)
    sched.leave(key=1, follows=True)  # its message was evaluated: its reply's first token follows
    out: dict[int, int] = {}
    th = threading.Thread(target=lambda: out.__setitem__(0, sched.submit(0)))
    th.start()
    time.sleep(1.5 * window)  # later than one window after the token, within three after the message
    sched.join(1)
    out[1] = sched.submit(1)
    th.join()
    assert run.batches == [[0, 1]]  # one run, not the token alone and the first token after it
    # A caller that does not come back holds a round up by at most three windows, and only once.
    sched.leave(key=1, follows=True)
    t0 = time.monotonic()
    assert sched.submit(2) == 20
    waited = time.monotonic() - t0
    assert 2.5 * window < waited < 3 * window + 0.2
    t0 = time.monotonic()
    assert sched.submit(3) == 30
    assert time.monotonic() - t0 < window + 0.2  # expected back by a message still, no more by tokens
    assert sched.returning() == 1
    sched.leave(key=0)
