"""A producer engine process and an in-process consumer server on 127.0.0.1, the two requests
vLLM's disaggregation proxy makes, and a relay that breaks transfers on purpose.

The producer is a real `kvasir-engine serve` process (so a test can kill it); the consumer is a
live server in this process (so a test can read its block pool). Prompts are token ids, so
both sides see the same tokens without a tokenizer in between.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import LiveServer, live_server, tiny_config
from kvasir_engine.config import EngineConfig, KVTransferConfig, ParallelConfig
from kvasir_engine.frontend.llm_engine import LLMEngine
from kvasir_engine.kv_transfer.wire import BLOCK_HEAD_BYTES
from processes import Node, free_port, start_engine, wait_ready

MODEL_NAME = "test"
# A named tenant on both sides: the prefix hashes are salted by tenant, and a bare key's tenant
# name is keyed by a per-process secret, so the two engines would disagree on it.
API_KEY = "disagg-key"
TENANT_KEY = f"team-a:{API_KEY}"


def post_ok(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST as the tenant both engines know; the 200 answer's JSON."""
    resp = httpx.post(f"{base_url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


@dataclasses.dataclass
class Producer:
    node: Node
    base_url: str
    kv_port: int

    def prefill(self, prompt: list[int], max_tokens: int = 16,
                cache_salt: str | None = None) -> dict[str, Any]:
        """vLLM's proxy's first request: the prompt, max one token, do_remote_decode."""
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "kv_transfer_params": {
                    "do_remote_decode": True, "do_remote_prefill": False,
                    "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                    "remote_port": None}}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return post_ok(self.base_url, "/v1/completions", body)

    def metrics_page(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text

    def kv_usage(self) -> float:
        for line in self.metrics_page().splitlines():
            if line.startswith("vllm:kv_cache_usage_perc{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no vllm:kv_cache_usage_perc")

    def wait_kv_usage_zero(self, timeout: float = 30.0) -> None:
        """Until the producer holds no block: every transfer released (fetched or expired)."""
        deadline = time.monotonic() + timeout
        while (usage := self.kv_usage()) > 0:
            assert time.monotonic() < deadline, f"the producer still holds blocks: {usage}"
            time.sleep(0.05)


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1 (a tensor-parallel producer's
    rank r serves on kv_port + r)."""
    while True:
        first = free_port()
        sockets: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()


@contextlib.contextmanager
def producer_process(model: Path, log_dir: Path, *, dtype: str = "float32",
                     hold_timeout_s: float = 30.0, connector: str = "TCPConnector",
                     tp_size: int = 1) -> Iterator[Producer]:
    port, kv_port = free_port(), free_port_run(tp_size)
    transfer = {"kv_connector": connector, "kv_role": "kv_producer",
                "kv_ip": "127.0.0.1", "kv_port": kv_port,
                "kv_connector_extra_config": {"hold_timeout_s": hold_timeout_s}}
    node = start_engine("serve", model, log_dir / f"producer-{port}.log",
                        "--host", "127.0.0.1", "--port", str(port), "--api-key", TENANT_KEY,
                        "--served-model-name", MODEL_NAME, "--max-model-len", "256",
                        "--block-size", "4", "--kv-cache-memory", "4MiB", "--dtype", dtype,
                        "--device", "cpu", "--no-warmup", "--tensor-parallel-size", str(tp_size),
                        "--kv-transfer-config", json.dumps(transfer))
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(node, base_url)
        yield Producer(node, base_url, kv_port)
    finally:
        node.stop()


def consumer_config(model: Path, *, dtype: str = "float32", prefix_caching: bool = False,
                    kv_buffer_size: int = 1 << 30, transfer_timeout_s: float = 10.0,
                    connector: str = "TCPConnector", tp_size: int = 1) -> EngineConfig:
    base = tiny_config(model, prefix_caching=prefix_caching)
    return dataclasses.replace(
        base, model=dataclasses.replace(base.model, dtype=dtype),
        parallel=ParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer=KVTransferConfig(connector, "kv_consumer",
                                     kv_buffer_size=kv_buffer_size,
                                     transfer_timeout_s=transfer_timeout_s))


@contextlib.contextmanager
def consumer_server(config: EngineConfig) -> Iterator[LiveServer]:
    engine = LLMEngine.from_config(config)
    with live_server(config, engine, warmup=False, api_keys=(TENANT_KEY,)) as live:
        yield live


def decode(consumer: LiveServer, prompt: list[int], params: dict[str, Any] | None,
           max_tokens: int = 16, cache_salt: str | None = None) -> list[str]:
    """vLLM's proxy's second request (or, without params, the same request run whole): the
    greedy completion, token by token (each token's text, from its logprobs)."""
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "logprobs": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    resp = consumer.post("/v1/completions", api_key=API_KEY, json=body)
    assert resp.status_code == 200, resp.text
    tokens: list[str] = resp.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == max_tokens
    return tokens


def free_blocks(consumer: LiveServer) -> tuple[int, int]:
    """(free, usable) blocks of the consumer's pool once it is idle."""
    consumer.wait_idle()
    kv = consumer.state.async_engine.engine_thread.engine.core.scheduler.kv_cache_manager
    return kv.num_free_blocks, kv.block_pool.num_usable_blocks


def fallback_case(consumer: LiveServer, producer: Producer, prompt: list[int],
                  params: dict[str, Any], reason: str) -> None:
    """The decode request with these params answers as a local run does, after one fallback
    for `reason`; nothing is left held or staged on either side."""
    connector = consumer.state.kv_connector
    assert connector is not None
    before = dict(connector.stats.fallbacks)
    num_free = free_blocks(consumer)
    assert decode(consumer, prompt, params) == decode(consumer, prompt, None)
    after = connector.stats.fallbacks
    assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {reason: 1}, after
    assert consumer.metric("kvasir:kv_transfer_fallbacks_total", reason=reason) == after[reason]
    assert free_blocks(consumer) == num_free
    assert connector.num_staged == 0
    producer.wait_kv_usage_zero()


def leave_before_first_step(consumer: LiveServer, producer: Producer, prompt: list[int],
                            caplog_text: Callable[[], str]) -> None:
    """A decode request whose client hangs up after its admission, before its first step: the
    server drops its staged blocks, the request, scheduled with its blocks gone, fails alone,
    and nothing stays held anywhere (`caplog_text`: the engine's log so far)."""
    params = producer.prefill(prompt)["kv_transfer_params"]
    connector = consumer.state.kv_connector
    assert connector is not None
    num_free = free_blocks(consumer)
    engine_thread = consumer.state.async_engine.engine_thread
    engine_thread.step_gate.clear()  # the engine admits the request, then stops before a step
    try:
        with pytest.raises(httpx.TimeoutException):  # the client gives up and hangs up
            consumer.post("/v1/completions", api_key=API_KEY, timeout=2.0, json={
                "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params})
        deadline = time.monotonic() + 30
        while connector.num_staged:  # the server dropped the staged blocks on the hang-up
            assert time.monotonic() < deadline, "the staged blocks were never dropped"
            time.sleep(0.02)
    finally:
        engine_thread.step_gate.set()
    assert free_blocks(consumer) == num_free and connector.num_staged == 0
    assert engine_thread.is_alive and "its received KV blocks are gone" in caplog_text()
    producer.wait_kv_usage_zero()


class Relay:
    """A TCP relay between a consumer and a producer's block server that breaks the stream the
    producer sends: "stall" forwards nothing, "cut" closes in the middle of the first block,
    "corrupt" flips a byte of the first block's payload; "pass" breaks nothing. It listens on
    `port` (0: any free one)."""

    def __init__(self, upstream_port: int, mode: str, port: int = 0) -> None:
        self.upstream_port, self.mode = upstream_port, mode
        self._server = socket.create_server(("127.0.0.1", port))
        self.port = self._server.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._server.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                threading.Thread(target=self._pipe, args=(conn, upstream), daemon=True).start()
                threading.Thread(target=self._back, args=(upstream, conn), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _back(self, upstream: socket.socket, conn: socket.socket) -> None:
        data = bytearray()
        with contextlib.suppress(OSError):
            while chunk := upstream.recv(1 << 16):
                if self.mode == "pass":
                    conn.sendall(chunk)
                    continue
                data += chunk
                if self.mode == "stall":
                    continue
                if len(data) < 4:
                    continue
                first_block = 4 + struct.unpack("<I", data[:4])[0] + BLOCK_HEAD_BYTES
                if self.mode == "cut" and len(data) > first_block + 8:
                    conn.sendall(bytes(data[:first_block + 8]))
                    break
                if self.mode == "corrupt" and len(data) > first_block:
                    data[first_block] ^= 0xFF
                    conn.sendall(bytes(data))
                    self.mode = "pass"
        if self.mode == "stall":
            self._closed.wait(30)
        for s in (conn, upstream):  # shutdown first: the other thread's recv holds the socket
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
