"""What the host offers that kernel and dtype choices depend on: CPU flags and oneDNN.

The one reader of /proc/cpuinfo for the engine (kernels/cpu.py asks for AVX2, kernels/choice.py
for AMX, args.py for bfloat16 arithmetic), and of the CPU share this process may use
(`cpu_threads`: OMP_NUM_THREADS, the affinity mask, the cgroup's quota); torch is imported only
when oneDNN is asked about.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from pathlib import Path


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_has(*flags: str) -> bool:
    """True when the CPU reports any of `flags` (names as /proc/cpuinfo spells them)."""
    return not _cpu_flags().isdisjoint(flags)


def onednn_available() -> bool:
    """PyTorch was built with oneDNN (mkldnn), which runs its CPU bfloat16 products."""
    import torch

    return bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]


def cpu_threads(environ: Mapping[str, str] | None = None,
                cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """How many compute threads this process should run, and why.

    `OMP_NUM_THREADS` when it is set, at most the CPUs this process may run on (what PyTorch
    and every OpenMP program honour: several engines on one host each take their share);
    otherwise the CPUs this process may run on, capped by its cgroup's CPU quota. A pod limited to 4 CPUs on a 64-core node still sees 64
    CPUs in its affinity mask, and 64 spinning OpenMP threads on a 4-CPU quota are throttled
    most of each period; two engines of 2 threads each on 2 cores ran 10-20x slower than one.
    """
    env = os.environ if environ is None else environ
    allowed = len(os.sched_getaffinity(0))
    requested = env.get("OMP_NUM_THREADS", "").strip()
    if requested:
        try:
            count = int(requested.split(",")[0])  # OpenMP allows a list per nesting level
        except ValueError:
            count = 0
        if count > 0:  # more threads than CPUs to run them on only contend
            return (min(count, allowed), f"OMP_NUM_THREADS={requested}" if count <= allowed
                    else f"OMP_NUM_THREADS={requested}, capped at the affinity mask's CPUs")
    count, why = allowed, "CPUs in the affinity mask"
    quota = _cgroup_cpu_quota(cgroup_root)
    if quota is not None and quota < count:
        count, why = quota, "the cgroup's CPU quota"
    return max(1, count), why


def _cgroup_cpu_quota(root: Path) -> int | None:
    """The CPU quota rounded up to whole CPUs (cgroup v2 cpu.max, else v1), None if unlimited."""
    try:
        quota, _, period = (root / "cpu.max").read_text().partition(" ")
        if quota.strip() == "max":
            return None
        return math.ceil(int(quota) / int(period))
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return math.ceil(quota_us / period_us) if quota_us > 0 and period_us > 0 else None
