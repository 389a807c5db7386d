"""Compute threads sized to the cores this process really gets, while it runs.

`cpu_threads` (host.py) sizes the team at start from OMP_NUM_THREADS, the affinity mask and the
cgroup's CPU quota. A neighbour at our own priority on our cores is none of those, and it costs
more than its share: every operator splits its work evenly over the team and waits for the
last thread, so the thread that shares its core with the neighbour, running in the scheduler's
time slices, holds the whole step. Measured on a 2-core EPYC (single stream, the default
model; bench/serving.py --noise): beside one busy process at equal priority 2 threads made
0.28x the tokens/s they make alone (inter-token p99 13x), 1 thread 0.99x of its own (0.72x of
2 threads alone); vLLM's CPU build made 0.56x. Beside the same process under `nice 19` the
team lost nothing (the scheduler preempts it as soon as a thread of ours wakes).

So `ThreadGovernor` watches, once a second, how long the compute threads waited while runnable
(the kernel's per-thread schedstat run delay, /proc/self/task/TID/schedstat) and how much CPU
the whole process used. The compute threads waiting for a core (`WAIT` of the window or more)
while the process left a core's worth unused (`HEADROOM`) means someone else runs on our
cores: two such windows in a row take one thread off the team. Waits while the process itself
uses every core are its own threads contending (the HTTP thread beside a full team): those
never shrink it. A shrunk team tries one thread more two windows after its last change when its CPUs idle half
a core or more (`FREE`: the neighbour left; /proc/stat over the affinity mask's CPUs), else
after `PROBE_SECONDS`, a wait that doubles with each failed try (up to `PROBE_MAX_SECONDS`); it
keeps the thread when the next windows are clean, else goes back.

The team size changes between steps only, on the thread that runs them (an OpenMP team's size
belongs to the thread that starts it). Results do not depend on it for the native kernels
(each output is one thread's work); oneDNN's may round differently, so `--batch-invariant`
keeps the team fixed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# (cpu seconds, seconds waited while runnable) per thread id
ThreadTimes = Mapping[int, tuple[float, float]]


def read_idle_seconds(stat: str = "/proc/stat") -> float:
    """Idle (and I/O wait) time so far of the CPUs this process may run on, in seconds;
    0.0 where /proc/stat cannot be read."""
    allowed = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    ticks = 0
    try:
        with open(stat) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in allowed:
                    ticks += int(fields[4]) + int(fields[5])  # idle, iowait
    except (OSError, ValueError, IndexError):
        return 0.0
    return ticks / os.sysconf("SC_CLK_TCK")


def read_thread_times(task_dir: str = "/proc/self/task") -> ThreadTimes:
    """Every thread's CPU time and run delay so far (schedstat, nanoseconds -> seconds);
    empty where the kernel does not keep schedstat."""
    times: dict[int, tuple[float, float]] = {}
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/schedstat") as f:
                cpu_ns, delay_ns, _ = f.read().split()
        except (OSError, ValueError):
            continue  # the thread ended between the listing and the read
        times[int(tid)] = (int(cpu_ns) / 1e9, int(delay_ns) / 1e9)
    return times


@dataclass(frozen=True)
class Window:
    """One window's figures: the busiest compute thread's share of it spent waiting, and the
    whole process's CPU in cores."""

    max_wait_share: float
    process_cores: float
    idle_cores: float  # the process's CPUs' idle time over the window, in cores


class ThreadGovernor:
    WINDOW_SECONDS = 1.0
    BUSY = 0.25  # a thread that ran this share of a window is a compute thread
    WAIT = 0.15  # one that waited this share of it while runnable: its core is shared
    HEADROOM = 0.5  # the process left at least this many cores unused: not its own threads
    FREE = 0.5  # this much idle time on the process's CPUs, in cores: a core to take back
    STRIKES = 2  # contended windows in a row before a thread goes
    PROBE_SECONDS = 10.0
    PROBE_MAX_SECONDS = 160.0

    def __init__(self, budget: int, set_threads: Callable[[int], None],
                 read: Callable[[], ThreadTimes] = read_thread_times,
                 read_idle: Callable[[], float] = read_idle_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`budget`: the team's size at start (cpu_threads): the cores the process means to
        use, which `HEADROOM` is measured against."""
        self.budget = budget
        self.threads = budget
        self._set, self._read, self._read_idle, self._clock = set_threads, read, read_idle, clock
        self._since: float | None = None
        self._times: ThreadTimes = {}
        self._idle = 0.0
        self._strikes = 0
        self._clean = 0
        self._probing = False
        self._probe_wait = self.PROBE_SECONDS
        self._changed_at = clock()

    def tick(self) -> None:
        """Called before each step, on the thread that runs it: at most one read of /proc a
        window."""
        if self.budget <= 1:
            return
        now = self._clock()
        if self._since is None:
            self._since, self._times, self._idle = now, self._read(), self._read_idle()
            return
        if now - self._since < self.WINDOW_SECONDS:
            return
        times, idle = self._read(), self._read_idle()
        window = self._measure(self._times, times, idle - self._idle, now - self._since)
        self._since, self._times, self._idle = now, times, idle
        if window is not None:
            self._decide(window, now)

    def _measure(self, before: ThreadTimes, after: ThreadTimes, idle: float,
                 seconds: float) -> Window | None:
        """None when nothing computed in the window (an idle engine says nothing)."""
        used = {tid: (cpu - before[tid][0], delay - before[tid][1])
                for tid, (cpu, delay) in after.items() if tid in before}
        busy = [(cpu, delay) for cpu, delay in used.values() if cpu >= self.BUSY * seconds]
        if not busy:
            return None
        return Window(max_wait_share=max(delay for _, delay in busy) / seconds,
                      process_cores=sum(cpu for cpu, _ in used.values()) / seconds,
                      idle_cores=idle / seconds)

    def _contended(self, w: Window) -> bool:
        return w.max_wait_share >= self.WAIT and w.process_cores <= self.budget - self.HEADROOM

    def _decide(self, w: Window, now: float) -> None:
        if self._contended(w):
            self._clean = 0
            self._strikes += 1
            if self._probing:  # the core we tried is still taken: back, and try later
                self._probing = False
                self._probe_wait = min(2 * self._probe_wait, self.PROBE_MAX_SECONDS)
                self._resize(self.threads - 1, now, logging.DEBUG, w, "probe failed")
            elif self._strikes >= self.STRIKES and self.threads > 1:
                self._resize(self.threads - 1, now, logging.INFO, w,
                             "a neighbour runs on our cores at our priority")
            return
        self._strikes = 0
        self._clean += 1
        if self._probing and self._clean >= self.STRIKES:
            self._probing = False
            self._probe_wait = self.PROBE_SECONDS
            logger.info("compute threads: %d again (the cores are free)", self.threads)
        elif not self._probing and self.threads < self.budget and (
                now - self._changed_at >= self._probe_wait
                or (w.idle_cores >= self.FREE
                    and now - self._changed_at >= self.STRIKES * self.WINDOW_SECONDS)):
            self._probing = True
            self._clean = 0
            self._resize(self.threads + 1, now, logging.DEBUG, w, "probing a core")

    def _resize(self, threads: int, now: float, level: int, w: Window, why: str) -> None:
        logger.log(level, "compute threads: %d -> %d (%s: the busiest waited %.0f%% of the "
                   "last window for a core while this process used %.2f of %d cores)",
                   self.threads, threads, why, 100 * w.max_wait_share, w.process_cores,
                   self.budget)
        self.threads = threads
        self._set(threads)
        self._changed_at = now
        self._strikes = 0
