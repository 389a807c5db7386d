"""`run_in_own_thread`: the server loads the model on a thread that has ended before serving.

Why it matters (launch.py): an OpenMP pool left on the main thread by the load makes libgomp
throttle its spin-waits, so every parallel region of the engine thread wakes a sleeping worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from kvasir_engine.server.launch import run_in_own_thread


def test_runs_on_a_thread_that_has_ended_when_it_returns() -> None:
    seen: list[threading.Thread] = []

    def add(a: int, *, b: int) -> int:
        seen.append(threading.current_thread())
        return a + b

    assert run_in_own_thread(add, 1, b=2) == 3
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_reraises_the_error_on_the_calling_thread() -> None:
    def fail() -> None:
        raise ValueError("--kv-cache-memory is too small")

    with pytest.raises(ValueError, match="too small"):
        run_in_own_thread(fail)


# Counts the process's threads once the loader ran a parallel region: its OpenMP pool's workers
# stay when it ran on the calling thread, and leave with the thread under run_in_own_thread.
_POOL_SCRIPT = """
import os, sys, time, torch
from kvasir_engine.server.launch import run_in_own_thread
torch.set_num_threads(len(os.sched_getaffinity(0)))
x, w = torch.randn(256, 1024), torch.randn(1024, 1024)
def load():
    for _ in range(3):
        torch.nn.functional.linear(x, w)
def num_threads():
    return len(os.listdir("/proc/self/task"))
before = num_threads()
run_in_own_thread(load) if sys.argv[1] == "own" else load()
deadline = time.monotonic() + 10
while num_threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
print(num_threads() - before)
"""


def _extra_threads(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _POOL_SCRIPT, mode], capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 cores for an OpenMP pool")
def test_the_loaders_openmp_pool_leaves_with_it() -> None:
    if _extra_threads("caller") == 0:
        pytest.skip("this torch build keeps no per-thread OpenMP pool")
    assert _extra_threads("own") == 0
