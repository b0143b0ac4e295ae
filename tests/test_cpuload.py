"""FreeCores: the thread count follows the cores other processes leave free (fake clocks; no real load)."""

from __future__ import annotations

import os

from chatcli.backends.cpuload import FreeCores, read_proc_stat, running_others


class Machine:
    """A 2-CPU machine whose busy time, this process's CPU time and the clock the test advances."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.now = 100.0
        self.busy = 1000.0
        self.own = 5.0
        self.slept = 0.0
        self.running: int | None = 0  # other processes' threads running at this instant
        self.asked = 0

    def run(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` pass with other processes on ``others`` cores and this one on ``own``."""
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def sleep(self, seconds: float, others: float = 0.0) -> None:
        self.slept += seconds
        self.run(seconds, others=others, own=0.0)

    def running_now(self) -> int | None:
        self.asked += 1
        return self.running

    def cores(self, max_threads: int = 2, others_while_sleeping: float = 0.0) -> FreeCores:
        return FreeCores(max_threads, stat=lambda: (self.n, self.busy), own_cpu=lambda: self.own,
                         clock=lambda: self.now, n_usable=self.n,
                         sleep=lambda s: self.sleep(s, others_while_sleeping), running_now=self.running_now)


def test_idle_machine_uses_every_thread_even_while_this_process_is_busy() -> None:
    m = Machine()
    fc = m.cores()
    m.run(1.0, others=0.1, own=2.0)  # our own spinning team must not count as someone else's load
    assert fc.threads() == 2


def test_one_competing_process_leaves_one_thread() -> None:
    m = Machine()
    fc = m.cores()
    m.run(1.0, others=0.7, own=1.3)  # a CPU-bound process gets its fair share of the two cores
    assert fc.threads() == 1
    m.run(1.0, others=0.05, own=1.0)  # it ended: back to two
    assert fc.threads() == 2


def test_a_fully_loaded_machine_still_gets_one_thread() -> None:
    m = Machine()
    fc = m.cores()
    m.run(1.0, others=2.0, own=0.0)
    assert fc.threads() == 1


def test_looks_again_only_after_the_interval() -> None:
    m = Machine()
    fc = m.cores()
    m.run(1.0, others=1.0, own=1.0)
    assert fc.threads() == 1
    m.run(0.1, others=0.0, own=2.0)
    assert fc.threads() == 1  # 0.1 s later: the previous answer, no new sample
    m.run(0.5, others=0.0, own=2.0)
    assert fc.threads() == 2  # judged over the 0.6 s since the last look


def test_not_adaptive_when_proc_stat_counts_other_cpus_or_is_missing() -> None:
    m = Machine(n=64)  # a container seeing the host's CPUs
    fc = FreeCores(2, stat=lambda: (64, m.busy), own_cpu=lambda: m.own, clock=lambda: m.now, n_usable=2)
    m.run(1.0, others=60.0, own=0.0)
    assert not fc.adaptive and fc.threads() == 2
    none = FreeCores(2, stat=lambda: None, n_usable=2)
    assert not none.adaptive and none.threads() == 2


def test_reads_this_machines_proc_stat(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\n"
                    "cpu1 50 0 25 400 25 0 0 0 0 0\nintr 1\n")
    got = read_proc_stat(str(stat))
    assert got is not None
    n, busy = got
    assert n == 2 and abs(busy - 150 / os.sysconf("SC_CLK_TCK")) < 1e-9
    assert read_proc_stat(str(tmp_path / "missing")) is None


def test_the_first_look_judges_the_time_since_construction_not_the_load_average() -> None:
    # The engine makes its FreeCores before loading the model: the first decode judges the load's time.
    m = Machine()
    fc = m.cores()
    m.run(0.3, others=1.0, own=1.0)  # another process held a core while the model loaded
    assert fc.threads() == 1 and m.slept == 0.0  # no wait: the window was long enough
    m = Machine()
    fc = m.cores()
    m.run(0.3, others=0.0, own=1.0)  # an idle machine, however high the load average still is
    assert fc.threads() == 2


def test_a_first_decode_right_after_construction_waits_for_a_short_window() -> None:
    m = Machine()
    fc = m.cores(others_while_sleeping=2.0)
    m.run(0.01, others=2.0, own=0.0)
    assert fc.threads() == 1  # judged over 0.1 s, not one or two 10 ms clock ticks
    assert abs(m.slept - 0.09) < 1e-9
    m.run(0.01, others=0.0, own=2.0)
    assert fc.threads() == 1 and abs(m.slept - 0.09) < 1e-9  # later looks never wait: the interval rules


def test_after_a_long_pause_what_runs_now_caps_the_stale_average() -> None:
    # A server between requests: another process ran through most of the pause and has just ended.
    m = Machine()
    fc = m.cores()
    m.run(0.3, others=0.0, own=1.0)
    assert fc.threads() == 2
    m.run(3.0, others=1.8, own=0.0)
    m.running = 0
    assert fc.threads() == 2  # the average says 1.8 cores busy; nothing else runs now
    m.run(3.0, others=1.0, own=0.0)
    m.running = 1
    assert fc.threads() == 1  # it still runs: one thread, no spinning against it


def test_a_short_window_is_judged_by_its_average_alone() -> None:
    m = Machine()
    fc = m.cores()
    m.run(0.3, others=0.0, own=1.0)
    fc.threads()
    asked = m.asked
    m.run(0.5, others=1.0, own=1.0)
    m.running = 0  # an instant's snapshot must not overrule half a second of measurement
    assert fc.threads() == 1 and m.asked == asked


def test_running_others_counts_other_processes_runnable_threads(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 0 1 1 0 0 0 0 0 0\nprocs_running 5\nprocs_blocked 0\n")
    tasks = tmp_path / "task"
    for tid, state in (("10", "R"), ("11", "S"), ("12", "R")):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "stat").write_text(f"{tid} (a (odd) name) {state} 1 2 3\n")
    assert running_others(str(stat), str(tasks)) == 3
    assert running_others(str(tmp_path / "missing"), str(tasks)) is None
    real = running_others()
    assert real is None or real >= 0


def test_the_process_that_woke_us_is_not_taken_for_a_competitor() -> None:
    # After a pause in which another process ran (a benchmark's other method, a build that ended), the
    # message arrives from a process that is still running for a millisecond or two after its write.
    m = Machine()
    looks = iter([1, 0])
    fc = FreeCores(2, stat=lambda: (m.n, m.busy), own_cpu=lambda: m.own, clock=lambda: m.now, n_usable=m.n,
                   sleep=m.sleep, running_now=lambda: next(looks))
    m.run(0.3, others=0.0, own=1.0)
    assert fc.threads() == 2
    m.run(3.0, others=1.8, own=0.0)
    assert fc.threads() == 2
    assert 0 < m.slept < 0.01  # a few milliseconds, not a measuring window


def test_what_keeps_running_still_caps_after_several_looks() -> None:
    m = Machine()
    fc = m.cores()
    m.run(0.3, others=0.0, own=1.0)
    fc.threads()
    m.run(3.0, others=1.0, own=0.0)
    m.running = 1
    asked = m.asked
    assert fc.threads() == 1 and m.asked - asked == 4
