"""How many CPU threads a decode should use right now: the cores other processes leave free.

ggml's CPU threads meet at a barrier after every operation of a graph (hundreds per token). libgomp's waiting
threads spin there before sleeping, which is what llama.cpp's own tools do and what makes decoding fast on an
idle machine (measured: 2.7× faster than ``OMP_WAIT_POLICY=PASSIVE``). When another process holds a core, the
same spinning burns the core the late thread needs and decoding collapses (measured: 3–10× slower than
passive). The waiting policy is read once, when libgomp loads, so it cannot follow the machine's load; the
thread count can (``llama_set_n_threads`` before each decode): with one thread there is no barrier to wait
at, and with the cores free the team spins as llama.cpp's does. The figures are in bench/results/decode.md.

Other processes' load is measured, not guessed: the machine's busy CPU time (``/proc/stat``) minus this
process's own (``time.process_time``, every thread) over the time since the last look. Where that cannot be
read consistently (not Linux, or a container whose ``/proc/stat`` counts other CPUs than ours) the thread
count stays at its maximum.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def read_proc_stat(path: str = "/proc/stat") -> tuple[int, float] | None:
    """(number of CPUs, seconds all CPUs spent busy since boot), or None where /proc/stat is unreadable."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(1 << 16).decode("ascii", errors="replace")
    except OSError:
        return None
    busy: float | None = None
    n = 0
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:9]]
            if len(fields) < 5:
                return None
            # user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
            busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        elif line.startswith("cpu") and line[3:4].isdigit():
            n += 1
    return None if busy is None or n == 0 else (n, busy)


def running_others(stat_path: str = "/proc/stat", tasks: str = "/proc/self/task") -> int | None:
    """How many threads of other processes are running or runnable right now (``procs_running`` minus this
    process's threads in state R), or None where /proc cannot tell."""
    try:
        with open(stat_path, "rb") as fh:
            text = fh.read(1 << 16).decode("ascii", errors="replace")
        running = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("procs_running "))
        own = 0
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/stat", "rb") as fh:
                    # The state follows the command name, which is in parentheses and may hold anything.
                    own += fh.read(512).rpartition(b")")[2].split()[:1] == [b"R"]
            except OSError:
                continue  # the thread ended meanwhile
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return max(0, running - own)


# The pauses before each look at what runs now after a long pause (``FreeCores._running_looks``): at most
# 6 ms before a message's prompt, and only when something looks busy.
RUNNING_LOOKS_S = (0.0, 0.001, 0.002, 0.003)


class FreeCores:
    """Picks a thread count in 1..``max_threads`` from the cores other processes left free recently.

    ``threads()`` is cheap to call before every decode: it looks at the machine again only once ``interval``
    seconds have passed, and judges the load over the whole time since its previous look. The first look
    judges the time since construction (the engine makes one before loading the model, so that is usually
    the load's few hundred ms), waiting until ``first_window`` has passed if it has not: a first prompt batch
    can take seconds, and both spinning through it on a busy machine and halving it on an idle one cost most
    of them. (The 1-minute load average, used here before, still counts a process that ended a minute ago:
    a benchmark run right after another took one thread on an idle machine and evaluated prompts at half
    speed.) A look after a long pause (a server between requests) would judge a stale average: another
    process that ran through most of the pause and has just ended would cost the next prompt half its speed.
    Then the count of other processes' threads running right now caps the estimate.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        interval: float = 0.25,
        stat: Callable[[], tuple[int, float] | None] = read_proc_stat,
        own_cpu: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        n_usable: int | None = None,
        first_window: float = 0.1,
        sleep: Callable[[float], None] = time.sleep,
        stale_after: float = 1.0,
        running_now: Callable[[], int | None] = running_others,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self._interval = interval
        self._first_window = first_window
        self._sleep = sleep
        self._looked = False
        self._stale_after = stale_after
        self._running_now = running_now
        self._stat = stat
        self._own_cpu = own_cpu
        self._clock = clock
        self._current = self.max_threads
        first = stat()
        usable = n_usable if n_usable is not None else usable_cpus()
        # Adapting needs /proc/stat to count exactly the CPUs this process can use, and a choice to make.
        self.adaptive = first is not None and first[0] == usable and self.max_threads > 1
        self._n_cpus = usable
        self._last = (clock(), first[1] if first else 0.0, own_cpu())

    def _pick(self, free: float) -> int:
        # Round half up: a core that others use less than half the time is still worth a thread.
        return max(1, min(self.max_threads, math.floor(free + 0.5)))

    def _running_looks(self) -> int | None:
        """Other processes' running threads, the fewest of a few looks over ~6 ms. The process that just
        woke this one (a pipe's writer, the terminal or tmux passing on the Enter key, a benchmark's driver)
        is still running at the first look: measured, 1 at once and 0 two milliseconds later in 9 of 10
        tries, 0 by 5 ms in all. Taken as a competitor it cost a whole prompt batch half its threads (a
        benchmark's message of 465 tokens evaluated at 0.54x llama-bench's rate)."""
        fewest: int | None = None
        for pause in RUNNING_LOOKS_S:
            if pause:
                self._sleep(pause)
            got = self._running_now()
            if got is None:
                return fewest
            fewest = got if fewest is None else min(fewest, got)
            if fewest == 0:
                break
        return fewest

    def threads(self) -> int:
        if not self.adaptive:
            return self.max_threads
        now = self._clock()
        t0, busy0, own0 = self._last
        if not self._looked:
            # /proc/stat counts in clock ticks (10 ms): a shorter window would judge by one or two of them.
            if now - t0 < self._first_window:
                self._sleep(self._first_window - (now - t0))
                now = self._clock()
            self._looked = True
        elif now - t0 < self._interval:
            return self._current
        sample = self._stat()
        if sample is None:
            return self._current
        own = self._own_cpu()
        self._last = (now, sample[1], own)
        others = max(0.0, (sample[1] - busy0) - (own - own0)) / (now - t0)
        if now - t0 > self._stale_after:
            running = self._running_looks()
            if running is not None:
                others = min(others, float(running))
        self._current = self._pick(self._n_cpus - others)
        return self._current
