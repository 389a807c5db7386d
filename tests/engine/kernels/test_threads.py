"""kernels/threads.py: the compute team shrinks beside a neighbour at our priority, never for
its own contention, and grows back when the cores are free. A fake clock and fake schedstat
drive it; one test reads the real /proc."""

from __future__ import annotations

import argparse
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import tiny_engine_config, write_checkpoint
from kvasir_engine.args import add_engine_args
from kvasir_engine.kernels.threads import ThreadGovernor, read_idle_seconds, read_thread_times
from kvasir_engine.worker.model_runner import ModelRunner


class Host:
    """Per-thread (cpu, run delay) counters that a test advances a window at a time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.times: dict[int, tuple[float, float]] = {}
        self.sizes: list[int] = []
        self.idle = 0.0  # the CPUs' idle seconds so far
        self.idle_cores = 0.0  # the next windows' idle time, in cores

    def window(self, *threads: tuple[float, float], seconds: float = 1.0) -> None:
        """One window: each given thread ran `cpu` and waited `wait` of it (seconds)."""
        self.now += seconds
        self.idle += self.idle_cores * seconds
        for tid, (cpu, wait) in enumerate(threads):
            before = self.times.get(tid, (0.0, 0.0))
            self.times[tid] = (before[0] + cpu, before[1] + wait)

    def governor(self, budget: int = 2) -> ThreadGovernor:
        self.times = {tid: (0.0, 0.0) for tid in range(3)}  # the threads it finds at start
        g = ThreadGovernor(budget, self.sizes.append, read=lambda: dict(self.times),
                           read_idle=lambda: self.idle, clock=lambda: self.now)
        g.tick()  # the first tick only takes the counters
        return g

    def run(self, g: ThreadGovernor, *threads: tuple[float, float], windows: int = 1) -> None:
        for _ in range(windows):
            self.window(*threads)
            g.tick()


LOOP = (0.05, 0.01)  # the HTTP thread: little CPU
# Beside one busy process at our priority (measured: each compute thread ran ~0.6 of a
# second and waited ~0.4 of it; the process used ~1.2 of 2 cores).
SHARED = ((0.62, 0.38), (0.57, 0.41), LOOP)
QUIET = ((0.93, 0.03), (0.93, 0.02), LOOP)
ALONE = ((0.95, 0.02), LOOP)  # one compute thread, its core its own


def test_a_neighbour_at_our_priority_takes_a_thread_after_two_windows() -> None:
    host = Host()
    g = host.governor()
    host.run(g, *SHARED)
    assert g.threads == 2 and host.sizes == []
    host.run(g, *SHARED)
    assert g.threads == 1 and host.sizes == [1]
    host.run(g, *ALONE, windows=5)
    assert g.threads == 1


def test_quiet_and_niced_neighbours_and_our_own_contention_change_nothing() -> None:
    host = Host()
    g = host.governor()
    host.run(g, *QUIET, windows=20)
    # Sixteen streams: the HTTP thread busy beside a full team; the waits are our own.
    host.run(g, (0.8, 0.2), (0.8, 0.2), (0.4, 0.3), windows=20)
    assert g.threads == 2 and host.sizes == []


def test_a_single_window_of_contention_is_not_enough() -> None:
    host = Host()
    g = host.governor()
    for _ in range(10):
        host.run(g, *SHARED)
        host.run(g, *QUIET)
    assert host.sizes == []


def test_it_tries_the_core_again_and_keeps_it_when_free() -> None:
    host = Host()
    g = host.governor()
    host.run(g, *SHARED, windows=2)
    host.run(g, *ALONE, windows=int(ThreadGovernor.PROBE_SECONDS))
    assert host.sizes == [1, 2]  # the probe
    host.run(g, *QUIET, windows=5)
    assert g.threads == 2 and host.sizes == [1, 2]


def test_a_core_gone_idle_is_taken_back_without_the_long_wait() -> None:
    host = Host()
    g = host.governor()
    host.run(g, *SHARED, windows=2)
    host.run(g, *ALONE)
    for _ in range(int(ThreadGovernor.PROBE_SECONDS)):
        host.run(g, *(SHARED if g.threads == 2 else ALONE))
    assert host.sizes == [1, 2, 1]  # a failed probe: the next one would wait 20 s
    host.idle_cores = 0.9  # the neighbour left: its core idles
    host.run(g, *ALONE, windows=ThreadGovernor.STRIKES)  # two windows, not 20 s
    assert host.sizes[-1] == 2
    host.run(g, *QUIET, windows=3)
    assert g.threads == 2


def test_a_failed_probe_goes_back_and_waits_twice_as_long() -> None:
    host = Host()
    g = host.governor()
    host.run(g, *SHARED, windows=2)
    probes = []
    for _ in range(80):
        before = len(host.sizes)
        host.run(g, *(SHARED if g.threads == 2 else ALONE))
        if len(host.sizes) > before and host.sizes[-1] == 2:
            probes.append(host.now)
    assert host.sizes[0] == 1 and set(host.sizes) == {1, 2} and g.threads == 1
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]


def test_idle_windows_say_nothing_and_a_budget_of_one_is_left_alone() -> None:
    host = Host()
    g = host.governor()
    host.run(g, (0.0, 0.0), (0.0, 0.0), windows=50)
    assert host.sizes == []
    single = Host()
    g1 = single.governor(budget=1)
    single.run(g1, (0.6, 0.4), LOOP, windows=10)
    assert single.sizes == [] and g1.threads == 1


def test_reads_this_process_threads_from_proc() -> None:
    times = read_thread_times()
    if not times:
        pytest.skip("this kernel keeps no schedstat")
    assert threading.get_native_id() in times
    assert all(cpu >= 0 and delay >= 0 for cpu, delay in times.values())
    assert read_thread_times("/nonexistent") == {}
    assert read_idle_seconds() >= 0.0 and read_idle_seconds("/nonexistent") == 0.0


def test_the_cpu_runner_governs_its_team_unless_told_not_to_or_batch_invariant(
        tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "m", "llama", shard=False)
    base = tiny_engine_config(directory)
    base = replace(base, device=replace(base.device, device="cpu"))
    runner = ModelRunner(base)
    assert runner.threads is not None and runner.threads.budget == torch.get_num_threads()
    info = runner.initialize_kv_cache()
    assert info.kernels["cpu_threads"].endswith(", adaptive")  # /version shows it
    fixed = replace(base, device=replace(base.device, adaptive_cpu_threads=False))
    assert ModelRunner(fixed).threads is None
    invariant = replace(base, device=replace(base.device, batch_invariant=True))
    assert ModelRunner(invariant).threads is None


def test_the_flag_is_on_by_default_and_can_be_turned_off() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).adaptive_cpu_threads is True
    assert parser.parse_args(["--no-adaptive-cpu-threads"]).adaptive_cpu_threads is False
