# kvasir-operator and kvasir-fetch (the engine pods' initContainer). No torch.
# Build from the repo root: docker build -f docker/operator.Dockerfile .
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY operator /src/operator
RUN pip install /src/operator

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    HOME=/tmp
COPY --from=build /opt/venv /opt/venv
# Non-root; nothing is written outside /tmp and the mounted cache, so readOnlyRootFilesystem works.
RUN useradd --uid 1000 --no-create-home --home-dir /tmp kvasir
USER 1000:1000
# The only paths written at run time (/models: kvasir-fetch's cache), each a volume of the pod.
LABEL dev.kvasir.writable-paths="/tmp /models"
ENTRYPOINT []
CMD ["kvasir-operator", "run", "--all-namespaces"]
