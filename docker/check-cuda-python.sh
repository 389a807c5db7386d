#!/usr/bin/env bash
# The CUDA engine image's Python layer, checked where its base (nvidia/cuda, Ubuntu 24.04) cannot
# be pulled: pip resolves, for CPython 3.12 on manylinux x86-64 (docker/engine.Dockerfile's venv),
# torch at the Dockerfile's TORCH_VERSION (the wheel alone: its CUDA libraries come from the CUDA
# index) and triton plus every dependency of the engine package (fully), from wheel metadata only;
# nothing is downloaded (the CUDA torch is gigabytes). It shows each has a wheel for that
# interpreter and that they agree; it does not run the Dockerfile's apt step or build the image.
# Index: $TORCH_INDEX of the Dockerfile when reachable, else PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/engine.Dockerfile)
index=$(sed -n 's/^ARG TORCH_INDEX=//p' docker/engine.Dockerfile)
if ! timeout 10 python3 -c "import urllib.request; urllib.request.urlopen('$index/torch/')" \
     >/dev/null 2>&1; then
  echo "cuda-python: $index is not reachable; resolving against PyPI" >&2
  index=https://pypi.org/simple
fi
mapfile -t deps < <(python3 - <<'PY'
import tomllib
deps = tomllib.load(open("engine/pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))
PY
)
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
start=$SECONDS
# Only the index named here (no local find-links or extra indexes of this machine's pip), with
# its TLS settings.
cert=$(python3 -m pip config list 2>/dev/null | sed -n "s/^global.cert='\(.*\)'$/\1/p" | head -1)
pip=(env PIP_CONFIG_FILE=/dev/null python3 -m pip --disable-pip-version-check ${cert:+--cert "$cert"})
platform=(--python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --only-binary=:all: --index-url "$index")
# torch alone: its CUDA libraries come from the CUDA index the Dockerfile names, not checked here.
"${pip[@]}" install --dry-run --quiet --report "$target/torch.json" --ignore-installed --no-deps \
  --target "$target/site" "${platform[@]}" "torch==$version"
"${pip[@]}" install --dry-run --quiet --report "$target/report.json" --ignore-installed \
  --target "$target/site" "${platform[@]}" triton "${deps[@]}"
report=$target/report.json
python3 - "$target/torch.json" "$version" 0 >/dev/null <<'PY'
import json, sys
torch = json.load(open(sys.argv[1]))["install"][0]["metadata"]["version"]
assert torch.split("+")[0] == sys.argv[2], torch
PY
python3 - "$report" "$version" $((SECONDS - start)) <<'PY'
import json, sys
report, version, seconds = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
items = {i["metadata"]["name"].lower(): i for i in report["install"]}
size = sum(int((i.get("download_info") or {}).get("archive_info", {}).get("size", 0) or 0)
           for i in items.values())
print(f"images: kvasir-engine CUDA Python layer resolves for CPython 3.12: torch {version}, "
      f"triton {items['triton']['metadata']['version']}, {len(items)} distributions "
      f"(resolved in {seconds} s from metadata; the layer would download them)")
PY
