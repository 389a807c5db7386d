#!/usr/bin/env bash
# GPU check (< 8 minutes on one CUDA GPU): kernel tests compiled for real, decode-attention
# bandwidth vs peak, Llama-3-8B-shaped decode/prefill throughput at batch 1/16/64, eager vs
# CUDA graphs. JSON lands in bench/results/gpu_check.json (or $1). Without a GPU it says what
# it skipped and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
OUT="${1:-bench/results/gpu_check.json}"
exec timeout 480 "$PY" bench/gpu_check.py --out "$OUT"
