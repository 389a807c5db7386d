"""What every benchmark in bench/ does last: write its result as JSON and its plot as PNG."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
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


def vllm_child(vllm_dir: Path, script: Path, args: list[str], payload: object,
               mark: str) -> dict:
    """Runs `script args --input FILE --vllm-model MODEL` with the python of vLLM's virtualenv
    (../shared/tools/install-vllm-cpu DIR), its engine in-process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, so torch.profiler sees its operators), FILE holding
    `payload` as JSON and MODEL its bfloat16 copy of the default model; returns the JSON the
    child printed on the line starting with `mark`."""
    python = vllm_dir / "venv-vllm" / "bin" / "python"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(payload, file)
        file.flush()
        done = subprocess.run(
            [str(python), str(script), *args, "--input", file.name,
             "--vllm-model", str(vllm_dir / "smollm2-hf-bf16")],
            env=env, capture_output=True, text=True, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(mark)), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"vllm run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(line.removeprefix(mark)))
