"""Real `kvasir-engine` processes for tests: one server, or the "nodes" of one multi-node engine
started as separate processes on the loopback (each its own --node-rank, as pods would be).

Every process writes its output to a log file the failing assertion shows; `Node.stop` kills
what is left, so a failing test leaves no process behind. Each starts its own process group (as
a pod's processes are their own), so a test can stop or kill a node whole (`Node.signal_all`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# Flags every test engine on a tiny checkpoint shares: small, float32, CPU.
TINY_FLAGS = ["--max-model-len", "128", "--block-size", "4", "--kv-cache-memory", "4MiB",
              "--max-num-seqs", "4", "--dtype", "float32", "--device", "cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    log_path: Path  # stderr (logs, the one-line errors)
    out_path: Path  # stdout (generate's answer)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """The exit code within `timeout` seconds (the log on failure)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout}s:\n{self.log}") from None

    def error_line(self) -> str:
        """The last line this process wrote (its one-line verdict)."""
        lines = [line for line in self.log.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def signal_all(self, sig: int) -> None:
        """`sig` to the node's every process (its ranks too), as if its host vanished."""
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        try:  # what it left behind (its ranks die with it, but a stopped one waits for this)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_engine(command: str, model: Path, log_path: Path, *flags: str,
                 env: dict[str, str] | None = None) -> Node:
    """`python -m kvasir_engine.main COMMAND MODEL FLAGS...`: stderr to `log_path`, stdout
    beside it (`.out`); `env` adds to the environment."""
    out_path = log_path.with_suffix(".out")
    proc = subprocess.Popen([sys.executable, "-m", "kvasir_engine.main", command, str(model),
                             *flags], stdout=out_path.open("wb"), stderr=log_path.open("wb"),
                            env={**os.environ, **(env or {})}, start_new_session=True)
    return Node(proc, log_path, out_path)


def start_nodes(command: str, model: Path, log_dir: Path, nnodes: int, *flags: str,
                node_flags: dict[int, list[str]] | None = None,
                env: dict[str, str] | None = None) -> list[Node]:
    """The `nnodes` nodes of one engine, node 0 first; `node_flags` adds flags to some."""
    port = free_port()
    nodes = []
    for rank in range(nnodes):
        extra = (node_flags or {}).get(rank, [])
        nodes.append(start_engine(command, model, log_dir / f"node{rank}.log", *flags,
                                  "--nnodes", str(nnodes), "--node-rank", str(rank),
                                  "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  *extra, env=env))
    return nodes


def wait_ready(node: Node, base_url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert node.proc.poll() is None, node.log
        try:
            if httpx.get(f"{base_url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server never became ready:\n" + node.log
        time.sleep(0.2)
