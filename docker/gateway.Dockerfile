# kvasir-gateway: the inference gateway (docs/gateway.md). No torch.
# Build from the repo root: docker build -f docker/gateway.Dockerfile .
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY gateway /src/gateway
RUN pip install /src/gateway

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    HOME=/tmp
COPY --from=build /opt/venv /opt/venv
# Non-root; nothing is written outside /tmp, so readOnlyRootFilesystem works.
RUN useradd --uid 1000 --no-create-home --home-dir /tmp kvasir
USER 1000:1000
# The only path written at run time, a volume of the chart's gateway pod.
LABEL dev.kvasir.writable-paths="/tmp"
EXPOSE 8080
ENTRYPOINT []
CMD ["kvasir-gateway"]
