"""A live Kvasir server on 127.0.0.1 for the server tests: uvicorn in a thread, real engine."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from helpers import tiny_engine_config
from kvasir_engine.config import EngineConfig
from kvasir_engine.frontend.llm_engine import LLMEngine
from kvasir_engine.server.api import create_app
from kvasir_engine.server.config import ServerConfig
from kvasir_engine.server.connections import uvicorn_config
from kvasir_engine.server.state import ServerState
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-1"


def tiny_config(model: Path, *, prefix_caching: bool = False, max_queue_len: int | None = None,
                max_num_seqs: int = 64, kv_bytes: int = 4 << 20) -> EngineConfig:
    base = tiny_engine_config(model, max_model_len=256, block_size=4, kv_bytes=kv_bytes)
    return dataclasses.replace(
        base,
        cache=dataclasses.replace(base.cache, enable_prefix_caching=prefix_caching),
        scheduler=dataclasses.replace(base.scheduler, max_queue_len=max_queue_len,
                                      max_num_seqs=max_num_seqs))


class LiveServer:
    def __init__(self, app: Any, server: uvicorn.Server, port: int) -> None:
        self.app = app
        self.server = server
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def state(self) -> ServerState:
        return self.app.state.kvasir  # type: ignore[no-any-return]

    def client(self, api_key: str | None = API_KEY, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key or "none",
                             max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY,
                                  max_retries=0, timeout=120, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 60)
        return httpx.get(self.base_url + path, **kwargs)

    def post(self, path: str, api_key: str | None = API_KEY, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        kwargs.setdefault("timeout", 60)
        return httpx.post(self.base_url + path, headers=headers, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels without model_name and engine): value}."""
        out = {}
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                      if k not in ("model_name", "engine")))
                out[(s.name, labels)] = s.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get("/ready").status_code == 200:
                return
            time.sleep(0.05)
        raise TimeoutError("server never became ready")

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and the gauges have been refreshed."""
        deadline = time.monotonic() + timeout
        engine = self.state.async_engine
        thread = engine.engine_thread
        while time.monotonic() < deadline:
            if not thread.has_work and engine.num_active_groups == 0 and not thread.has_stale_stats:
                return
            time.sleep(0.02)
        raise TimeoutError(f"engine never went idle: has_work={thread.has_work} "
                           f"groups={engine.num_active_groups} stale={thread.has_stale_stats}")


@contextlib.contextmanager
def live_server(engine_config: EngineConfig, engine: LLMEngine | None = None,
                on_fatal: Callable[[str], None] | None = None,
                span_exporter: Any = None, **server_overrides: Any) -> Iterator[LiveServer]:
    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "api_keys": (API_KEY,)}
    settings.update(server_overrides)
    server_config = ServerConfig(**settings)
    engine = engine or LLMEngine.from_config(engine_config)
    app = create_app(engine_config, server_config, engine, on_fatal=on_fatal,
                     span_exporter=span_exporter)
    server = uvicorn.Server(uvicorn_config(app, server_config, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        live = LiveServer(app, server, port)
        live.wait_ready()
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
