"""SIGTERM on a real `kvasir-engine serve` process: ready turns 503 at once, new requests get 503,
every in-flight stream completes, and the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

NUM_STREAMS = 16
MAX_TOKENS = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stream(base_url: str, index: int, events: dict[int, list[str]],
            started: threading.Semaphore) -> None:
    body = {"prompt": f"Hello {index}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    got: list[str] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got.append(line[6:])
                if len(got) == 1:
                    started.release()
    events[index] = got


def _num_in_engine(base_url: str) -> int:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def test_sigterm_drains_in_flight_streams_and_exits_0(tiny_model: Path, tmp_path: Path) -> None:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvasir_engine.main", "serve", str(tiny_model), "--host",
         "127.0.0.1", "--port", str(port), "--served-model-name", "test", "--max-model-len",
         "256", "--block-size", "4", "--kv-cache-memory", "4MiB", "--max-num-seqs", "4",
         "--dtype", "float32", "--shutdown-grace-seconds", "120"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{base_url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.2)

        events: dict[int, list[str]] = {}
        started = threading.Semaphore(0)
        threads = [threading.Thread(target=_stream, args=(base_url, i, events, started))
                   for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        for _ in range(4):  # the first wave is streaming (max-num-seqs 4); the rest are queued
            assert started.acquire(timeout=60)
        deadline = time.monotonic() + 60
        while _num_in_engine(base_url) < NUM_STREAMS:  # every stream admitted before the signal
            assert time.monotonic() < deadline, "streams were never all admitted"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)

        deadline = time.monotonic() + 10
        while httpx.get(f"{base_url}/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503"
            time.sleep(0.01)
        refused = httpx.post(f"{base_url}/v1/completions", timeout=10,
                             json={"prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"

        for t in threads:
            t.join(timeout=180)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert sorted(events) == list(range(NUM_STREAMS))
    for got in events.values():
        assert got[-1] == "[DONE]"
        chunks = [json.loads(e) for e in got[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS  # every token arrived
