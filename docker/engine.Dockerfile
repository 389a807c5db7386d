# kvasir-engine on CUDA. Build from the repo root: docker build -f docker/engine.Dockerfile .
# Non-root (uid 1000) and read-only-root friendly: every writable path is /tmp (an emptyDir
# mounted by the operator), /dev/shm (memory emptyDir for NCCL) or /models (the weight cache).
# One stage: build-essential and python3.12-dev stay because Triton compiles its launchers with
# the C compiler against Python.h at run time (into TRITON_CACHE_DIR).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" && pip install triton
COPY engine /src/engine
RUN pip install /src/engine && rm -rf /src

# Triton, torch and HF write caches under HOME: point them at /tmp (writable emptyDir).
ENV HOME=/tmp TRITON_CACHE_DIR=/tmp/triton HF_HOME=/tmp/hf XDG_CACHE_HOME=/tmp/.cache
RUN useradd --uid 1000 --no-create-home --home-dir /tmp kvasir
USER 1000:1000
# The only paths written at run time, each a volume of the rendered pod (tests/test_images.py).
LABEL dev.kvasir.writable-paths="/tmp /dev/shm"
EXPOSE 8000
ENTRYPOINT ["kvasir-engine"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
