#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the comparison baseline of bench/serving.py) from the llama.cpp
# sources vendored in the llama-cpp-python sdist on PyPI, and installs it as .tools/llama-server.
# About 12 minutes on 2 cores. Usage: bench/build_llama_server.sh [JOBS]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
JOBS="${1:-2}"
WORK="${KVASIR_LLAMA_BUILD_DIR:-/tmp/kvasir-llama-build}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
mkdir -p "$WORK" "$ROOT/.tools"
if ! ls "$WORK"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$WORK"
fi
SDIST="$(ls "$WORK"/llama_cpp_python-*.tar.gz | sort | tail -1)"
SRC="${SDIST%.tar.gz}"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$WORK"
cd "$SRC/vendor/llama.cpp"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice -n 10 cmake --build build --target llama-server -j "$JOBS"
install -m 0755 build/bin/llama-server "$ROOT/.tools/llama-server"
echo "installed $ROOT/.tools/llama-server ($(basename "$SRC"))"
