#!/usr/bin/env bash
# `make images`: build Kvasir's images from the same Dockerfiles users build.
#
# With a Docker daemon that answers, `docker build`; otherwise Debian's buildah (no daemon,
# `--isolation chroot`, which needs no user namespaces or cgroup setup). A base image that cannot
# be pulled (no registry reachable) is built locally from Debian packages with mmdebstrap and
# tagged with the exact name the FROM line uses, so the Dockerfiles stay as users build them.
# The torch CPU wheel is taken from pip's find-links directory when one holds it (docker/wheels,
# a build-context directory the Dockerfiles search first), so no build downloads it again.
#
# Usage: docker/build.sh [IMAGE...]   IMAGE: engine-cpu engine-cuda operator gateway (default all)
# Env: TAG (dev), BASE_CACHE (/var/cache/kvasir-images), BUILDER (docker|buildah, autodetected).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${TAG:-dev}
base_cache=${BASE_CACHE:-/var/cache/kvasir-images}
images=("$@")
[ ${#images[@]} -gt 0 ] || images=(engine-cpu engine-cuda operator gateway)

if [ -z "${BUILDER:-}" ]; then
  if command -v docker >/dev/null && timeout 10 docker info >/dev/null 2>&1; then BUILDER=docker
  else BUILDER=buildah; fi
fi
if [ "$BUILDER" = buildah ] && ! command -v buildah >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "images: installing Debian's buildah, podman and mmdebstrap" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      buildah podman mmdebstrap >/dev/null
  else
    echo "images: no Docker daemon answers and buildah is missing (apt-get install buildah)" >&2
    exit 1
  fi
fi
export BUILDAH_ISOLATION=chroot
echo "images: building with $BUILDER" >&2

has_image() {
  if [ "$BUILDER" = docker ]; then docker image inspect "$1" >/dev/null 2>&1
  else buildah inspect --type image "$1" >/dev/null 2>&1; fi
}

# The bases the FROM lines name that we know how to make from Debian packages: the official
# python:3.11-slim is Debian bookworm with Python 3.11, as is bookworm's python3 package.
debian_base() {
  local name=$1 tar=$base_cache/bookworm-python3.tar
  mkdir -p "$base_cache"
  if [ ! -f "$tar" ] || [ ! -s "$tar" ]; then
    rm -rf "$tar" "$tar.partial"
    echo "images: $name cannot be pulled; building it from Debian bookworm packages" >&2
    mmdebstrap --format=tar --variant=minbase \
      --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
      bookworm "$tar.partial" && mv "$tar.partial" "$tar"
  fi
  local change=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
                --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]')
  if [ "$BUILDER" = docker ]; then docker import "${change[@]}" "$tar" "$name" >/dev/null
  else podman import "${change[@]}" "$tar" "docker.io/library/$name" >/dev/null; fi
}

ensure_base() {
  local name=$1
  has_image "$name" && return 0
  if [ "$BUILDER" = docker ]; then timeout 120 docker pull -q "$name" >/dev/null 2>&1 && return 0
  else timeout 120 buildah pull -q "$name" >/dev/null 2>&1 && return 0; fi
  case "$name" in
    python:3.11-slim) debian_base "$name" ;;
    *) echo "images: $name cannot be pulled and has no local recipe" >&2; return 1 ;;
  esac
}

# The wheel pip would install for torch on this machine (its find-links directory), so the
# build installs the same one; an empty docker/wheels makes the build download it instead.
stage_wheels() {
  local dir
  for dir in $(python3 -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$/\1/p") \
             /opt/wheels; do
    compgen -G "$dir/torch-*+cpu-cp311-*.whl" >/dev/null || continue
    for whl in "$dir"/torch-*+cpu-cp311-*.whl; do
      [ -e "docker/wheels/$(basename "$whl")" ] || cp "$whl" docker/wheels/
    done
    return 0
  done
}

# A machine whose HTTPS goes through an inspecting proxy trusts its CA through pip's `cert`
# setting: the buildah builds mount that bundle and a pip.conf naming it into every RUN (build
# time only, nothing of it stays in an image). A Docker build would need the CA in the base.
build_mounts=()
host_ca=$(python3 -m pip config list 2>/dev/null | sed -n "s/^global.cert='\(.*\)'$/\1/p" | head -1)
if [ "$BUILDER" = buildah ] && [ -n "$host_ca" ] && [ -s "$host_ca" ]; then
  mkdir -p "$base_cache"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$base_cache/build-pip.conf"
  build_mounts=(--volume "$host_ca:/etc/ssl/certs/ca-certificates.crt:ro"
                --volume "$base_cache/build-pip.conf:/etc/pip.conf:ro")
fi

size_of() {
  if [ "$BUILDER" = docker ]; then docker image inspect -f '{{.Size}}' "$1"
  else buildah inspect --type image -f '{{.Size}}' "$1" 2>/dev/null \
       || podman image inspect -f '{{.Size}}' "$1"; fi
}

build() {  # NAME DOCKERFILE [BUILD-ARGS...]
  local name=$1 file=$2; shift 2
  local base
  for base in $(sed -n 's/^FROM \([^ ]*\).*/\1/p' "$file" | sort -u); do
    [[ "$base" == *'$'* ]] || ensure_base "$base"
  done
  local start=$SECONDS
  if [ "$BUILDER" = docker ]; then docker build -q -f "$file" -t "$name" "$@" . >/dev/null
  else buildah bud --isolation chroot --layers -q "${build_mounts[@]}" -f "$file" -t "$name" "$@" . >/dev/null; fi
  local bytes; bytes=$(podman image inspect -f '{{.Size}}' "$name" 2>/dev/null || size_of "$name")
  printf 'images: %-28s %6d MB  built in %4d s  (%s)\n' "$name" $((bytes / 1000000)) \
    $((SECONDS - start)) "$file" | tee -a "${IMAGES_LOG:-/dev/null}"
}

stage_wheels
for image in "${images[@]}"; do
  case "$image" in
    engine-cpu)
      args=()
      compgen -G "docker/wheels/torch-*+cpu-cp311-*.whl" >/dev/null && args=(--build-arg TORCH_INDEX=)
      build "kvasir-engine:$tag" docker/engine-cpu.Dockerfile "${args[@]}" ;;
    engine-cuda)
      if ensure_base nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 2>/dev/null; then
        build "kvasir-engine:$tag-cuda" docker/engine.Dockerfile
      else
        echo "images: nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 cannot be pulled here;" \
             "checking the CUDA image's Python layer instead (docker/check-cuda-python.sh)" >&2
        docker/check-cuda-python.sh
      fi ;;
    operator) build "kvasir-operator:$tag" docker/operator.Dockerfile ;;
    gateway) build "kvasir-gateway:$tag" docker/gateway.Dockerfile ;;
    *) echo "images: unknown image $image" >&2; exit 2 ;;
  esac
done
