"""What every benchmark in bench/ does last: write its result as JSON and its plot as PNG."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

HOST_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def host_line() -> str:
    """The host a figure came from: CPU model, cores, and the ISA flags our kernels choose by."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.processor() or '?'}, {os.cpu_count()} cores"
    lines = info.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return f"{model}, {os.cpu_count()} cores, {' '.join(f for f in HOST_FLAGS if f in flags)}"


def write_results(result: dict, out: Path, plot: Callable[[dict, Path], None]) -> None:
    """out.json holds `result` (with the host it ran on); plot(result, out.png) draws it."""
    result.setdefault("host_cpu", host_line())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
