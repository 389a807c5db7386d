"""A tensor-parallel rank killed under a real `kvasir-engine serve --tensor-parallel-size 2` (CPU,
gloo): the server turns unhealthy and exits non-zero within seconds, even with no request in
flight, and leaves no rank process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

# Seconds from the kill to the exit that the test tolerates (the server aims for about one).
EXIT_BOUND_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_pids(server_pid: int) -> list[int]:
    """The server's spawned rank processes (not multiprocessing's resource tracker)."""
    pids: list[int] = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children = (task / "children").read_text().split()
        pids += [int(p) for p in children]
    return sorted(p for p in pids
                  if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())


def _is_gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _wait_ready(proc: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{base_url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server never became ready:\n" + log.read_text()
        time.sleep(0.2)


@contextmanager
def _tp2_server(model: Path, log_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvasir_engine.main", "serve", str(model), "--host",
         "127.0.0.1", "--port", str(port), "--served-model-name", "test", "--max-model-len",
         "256", "--block-size", "4", "--kv-cache-memory", "4MiB", "--max-num-seqs", "4",
         "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2"],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, base_url, log_path)
        yield proc, base_url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _wait_exit(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    """The server log once the process has exited non-zero within the bound."""
    try:
        proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {EXIT_BOUND_S}s after the kill:\n"
                             f"{log_path.read_text()}") from None
    log = log_path.read_text()
    assert proc.returncode != 0, log
    assert "tensor-parallel rank 1" in log and "died" in log, log
    return log


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while not all(_is_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_is_gone(p) for p in pids), "a rank process outlived the server"


def test_killed_rank_makes_the_idle_server_unhealthy_and_exit_non_zero(
        tiny_model: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    with _tp2_server(tiny_model, log_path) as (proc, base_url):
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200

        os.kill(ranks[1], signal.SIGKILL)
        seen: list[str] = []  # what /health said after the kill, until the process ended
        deadline = time.monotonic() + EXIT_BOUND_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                resp = httpx.get(f"{base_url}/health", timeout=2)
                seen.append(f"{resp.status_code} {resp.json().get('reason', '')}")
            except httpx.HTTPError as e:
                seen.append(f"closed: {type(e).__name__}")
            time.sleep(0.05)
        _wait_exit(proc, log_path)
        # Once unhealthy (or closed) it never turned healthy again.
        bad = [i for i, s in enumerate(seen) if not s.startswith("200")]
        assert bad, seen
        assert all(not s.startswith("200") for s in seen[bad[0]:]), seen
        assert all("rank 1" in s for s in seen if s.startswith("503")), seen
        _wait_gone(ranks)


def test_killed_rank_ends_an_open_stream_and_the_server(tiny_model: Path,
                                                        tmp_path: Path) -> None:
    """Killed mid-generation: the stream ends with a 503 error event and the process exits."""
    log_path = tmp_path / "server.log"
    with _tp2_server(tiny_model, log_path) as (proc, base_url):
        ranks = _rank_pids(proc.pid)
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            try:
                with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                                  timeout=60) as resp:
                    for line in resp.iter_lines():
                        lines.append(line)
                        first.set()
            except httpx.HTTPError as e:
                lines.append(f"closed: {type(e).__name__}")
            first.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first.wait(60), "the stream never started"
        os.kill(ranks[1], signal.SIGKILL)
        _wait_exit(proc, log_path)
        reader.join(timeout=EXIT_BOUND_S)
        assert not reader.is_alive(), "the stream outlived the server"
        # The server lives on for a second after the death, so the stream ends with an error
        # event saying the engine is gone (a 503), not a generic 500 or a cut connection.
        errors = [json.loads(line.removeprefix("data: ")) for line in lines
                  if line.startswith('data: {"error"')]
        assert len(errors) == 1, lines[-5:]
        error = errors[0]["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "engine_dead", error
        assert "the engine loop died" in error["message"], error
        assert [line for line in lines if line][-1] == "data: [DONE]", lines[-5:]
        _wait_gone(ranks)
