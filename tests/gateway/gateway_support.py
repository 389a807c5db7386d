"""Real servers on 127.0.0.1 for the gateway tests: redis-server, fake engines, the gateway.

`FakeEngine` speaks the engine's API shape (OpenAI completions and chat, SSE with a final
usage chunk when asked, /ready, /metrics with the vllm: gauges, /v1/models) and records what it
received and which streams were cut off by the client, so routing and cancellation can be
observed from the upstream side. Every server runs in uvicorn on a free port in its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from kvasir_gateway.app import create_app
from kvasir_gateway.config import GatewayConfig
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-1"}  # the tenants of the `key_file` fixture
# What a fake producer answers a prefill with (the engine's fields, docs/disaggregation.md)
PRODUCER_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
                   "remote_engine_id": "127.0.0.1:14579", "remote_host": "127.0.0.1",
                   "remote_port": 14579, "remote_block_ids": [1, 2],
                   "remote_request_id": "cmpl-fake-0", "tp_size": 1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Served:
    """An ASGI app in uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any, port: int = 0) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass
class FakeEngine:
    model: str = "tiny"
    num_chunks: int = 3
    chunk_delay: float = 0.0  # seconds between stream chunks
    first_chunk_delay: float = 0.0  # seconds before a stream's first chunk (its "prefill")
    status: int = 200  # answer every generation with this status (errors in OpenAI shape)
    is_ready: bool = True
    answer_delay: float = 0.0  # seconds before answering (watching for the client leaving)
    # usage from the body (prompt words x 1.3, completion = max_tokens) instead of fixed counts
    is_usage_from_body: bool = False
    break_after: int | None = None  # a stream dies after this many chunks (the replica crashed)
    num_waiting: float = 0.0
    text: str | None = None  # the answer (finish_reason "stop"); None: "a" x num_chunks, "length"
    logprob: float = -0.1  # of every answer token, returned when the request asks for logprobs
    generation_tokens: float = 0.0  # vllm:generation_tokens_total as /metrics reports it
    # --kv-transfer-config's role its /version reports; a producer's non-streamed answer to
    # kv_transfer_params.do_remote_decode carries PRODUCER_PARAMS, as the engine's does
    kv_role: str | None = None
    received: list[dict[str, Any]] = field(default_factory=list)  # {"headers", "body"}
    cancelled: list[float] = field(default_factory=list)  # monotonic time a stream was cut

    def app(self) -> Starlette:
        async def ready(request: Request) -> Response:
            return JSONResponse({"ok": self.is_ready}, status_code=200 if self.is_ready else 503)

        async def metrics(request: Request) -> Response:
            return PlainTextResponse(
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="{self.model}"}} {self.num_waiting}\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} 0.5\n'
                "# TYPE vllm:generation_tokens counter\n"
                f'vllm:generation_tokens_total{{model_name="{self.model}"}} '
                f'{self.generation_tokens}\n')

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "kvasir"}]})

        async def version(request: Request) -> Response:
            return JSONResponse({"version": "fake", "kv_role": self.kv_role})

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.received.append({"headers": dict(request.headers), "body": body})
            waited = 0.0
            while waited < self.answer_delay:
                if await request.is_disconnected():
                    self.cancelled.append(time.monotonic())
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
                waited += 0.02
            if self.status != 200:
                return JSONResponse({"error": {"message": "fake failure", "type": "x",
                                               "param": None, "code": None}},
                                    status_code=self.status, headers={"retry-after": "7"})
            prompt, completion = 10, self.num_chunks
            if self.is_usage_from_body:
                prompt = round(len(str(body.get("prompt", "")).split()) * 1.3)
                completion = int(body.get("max_tokens") or 16)
            usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion}
            if not body.get("stream"):
                text = "a" * self.num_chunks if self.text is None else self.text
                finish = "length" if self.text is None else "stop"
                logprobs: Any = None
                is_chat = request.url.path.endswith("/chat/completions")
                if body.get("logprobs"):
                    values = [self.logprob] * max(1, len(text.split()))
                    logprobs = ({"content": [{"token": "w", "logprob": v, "bytes": None,
                                              "top_logprobs": []} for v in values]}
                                if is_chat else {"tokens": ["w"] * len(values),
                                                 "token_logprobs": values,
                                                 "top_logprobs": None, "text_offset": []})
                choice: dict[str, Any] = {"index": 0, "logprobs": logprobs,
                                          "finish_reason": finish}
                if is_chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                answer = {"id": "x", "object": "text_completion", "model": self.model,
                          "choices": [choice], "usage": usage}
                if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                    answer["kv_transfer_params"] = PRODUCER_PARAMS
                return JSONResponse(answer)
            include_usage = (body.get("stream_options") or {}).get("include_usage")

            async def events() -> Any:
                try:
                    await asyncio.sleep(self.first_chunk_delay)
                    for i in range(self.num_chunks):
                        if i == self.break_after:
                            raise RuntimeError("the fake engine broke off its stream")
                        chunk = {"id": "x", "choices": [{"index": 0, "text": f"t{i}",
                                                         "finish_reason": None}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        await asyncio.sleep(self.chunk_delay)
                    if include_usage:
                        yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.cancelled.append(time.monotonic())
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[
            Route("/ready", ready), Route("/metrics", metrics), Route("/v1/models", models),
            Route("/version", version),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"])])


@contextlib.contextmanager
def fake_engines(*engines: FakeEngine) -> Iterator[list[Served]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(Served(e.app())) for e in engines]


@contextlib.contextmanager
def gateway(span_exporter: Any = None, **overrides: Any) -> Iterator[Served]:
    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "probe_interval_seconds": 0.2}
    settings.update(overrides)
    with Served(create_app(GatewayConfig(**settings), span_exporter)) as served:
        yield served


def replace_file(path: Path, text: str) -> None:
    """Put a new version of a watched file in place at once, as the kubelet does for a mounted
    Secret or ConfigMap (`write_text` truncates first: a poll in between reads an empty file,
    which is itself a valid, empty version)."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(text)
    staged.replace(path)


def wait_until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def metric_value(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` with those labels on the /metrics page at `url`."""
    page = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(page) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def disaggregation_counts(url: str) -> dict[tuple[str, str], float]:
    """The gateway's kvasir_gateway_disaggregation_requests_total by (path, reason)."""
    page = httpx.get(url + "/metrics", timeout=10).text
    return {(s.labels["path"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(page) for s in family.samples
            if s.name == "kvasir_gateway_disaggregation_requests_total"}


def post(base: str, path: str, body: Any, key: str | None = None,
         **kwargs: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    kwargs.setdefault("timeout", 10)
    if isinstance(body, (bytes, str)):
        return httpx.post(base + path, content=body, headers=headers, **kwargs)
    return httpx.post(base + path, json=body, headers=headers, **kwargs)


class RedisServer:
    """A real redis-server on a free 127.0.0.1 port with a temporary directory."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (Debian package redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(directory),
             "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
