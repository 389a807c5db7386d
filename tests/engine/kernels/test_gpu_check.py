"""bench/gpu_check.sh on a machine without CUDA: it says what it skipped and exits 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="with a GPU the check runs for real (minutes)")


def test_gpu_check_script_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh"), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU found: SKIPPED" in proc.stdout
    report = json.loads(out.read_text())
    assert report["cuda"] is False
    assert report["skipped"] == ["kernel_tests", "attention_bandwidth", "model_throughput"]


def test_gpu_check_model_benchmark_code_runs_on_a_tiny_cpu_model(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check.py"), "--smoke-cpu",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    smoke = json.loads(out.read_text())["smoke_cpu"]
    assert [row["batch"] for row in smoke["rows"]] == [1, 16, 64]
    for row in smoke["rows"]:
        assert row["decode_eager_tok_s"] > 0 and row["prefill_tok_s"] > 0
        assert "decode_graph_tok_s" not in row  # graphs need CUDA
