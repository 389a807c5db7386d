"""What the host offers that kernel and dtype choices depend on: CPU flags and oneDNN.

The one reader of /proc/cpuinfo for the engine (kernels/cpu.py asks for AVX2, kernels/choice.py
for AMX, args.py for bfloat16 arithmetic); torch is imported only when oneDNN is asked about.
"""

from __future__ import annotations

import functools
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
