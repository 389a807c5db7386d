"""One engine over several "nodes": separate `kvasir-engine` processes on the loopback, each with
its own --node-rank, meeting at node 0's --master-addr/--master-port as pods of one
LeaderWorkerSet would. Greedy output equals one process's; start-up errors fail every node with
one line; a dead rank makes the leader answer 503 and exit; a dead leader ends the workers; a
node that vanishes whole while the engine is idle (its every process killed, or frozen so that
no socket closes, as when its host goes away) is noticed by its missing heartbeat."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from helpers import default_gguf_path, write_checkpoint
from processes import TINY_FLAGS, Node, free_port, start_engine, start_nodes, wait_ready

PROMPTS = ["The quick brown fox", "Hello world! Kvasir", "Paged attention keeps"]
GENERATE = ["--max-tokens", "12", "--ignore-eos", "--output", "json",
            *(flag for p in PROMPTS for flag in ("--prompt", p))]
# Seconds from a kill to the exits the tests tolerate (the engine aims for about one).
EXIT_BOUND_S = 30.0
# The vanished-node tests' --node-heartbeat-timeout: short, so they run fast.
HEARTBEAT_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("multinode") / "llama", "llama",
                            num_hidden_layers=4, hidden_size=128, intermediate_size=256)


def _tokens(node: Node) -> list[list[int]]:
    return [r["token_ids"] for r in json.loads(node.output)]


def _generate_alone(model: Path, log_dir: Path, *flags: str) -> list[list[int]]:
    node = start_engine("generate", model, log_dir / "alone.log", *flags, *GENERATE)
    try:
        assert node.wait(300) == 0, node.log
        return _tokens(node)
    finally:
        node.stop()


def _generate_on_nodes(model: Path, log_dir: Path, nnodes: int,
                       *flags: str) -> list[list[int]]:
    nodes = start_nodes("generate", model, log_dir, nnodes, *flags, *GENERATE)
    try:
        codes = [n.wait(300) for n in nodes]
        assert codes == [0] * nnodes, [n.log for n in nodes]
        return _tokens(nodes[0])
    finally:
        for n in nodes:
            n.stop()


@pytest.mark.parametrize("tp", [1, 2])
def test_pp2_on_two_nodes_matches_one_process(llama4: Path, tmp_path: Path, tp: int) -> None:
    alone = _generate_alone(llama4, tmp_path, *TINY_FLAGS)
    assert [len(t) for t in alone] == [12] * len(PROMPTS)
    spread = _generate_on_nodes(llama4, tmp_path, 2, *TINY_FLAGS, "-pp", "2", "-tp", str(tp))
    assert spread == alone


# One process, then two nodes of three ranks each, load the 135M GGUF: 45 s on an idle 2-core
# host, 79 s beside other work.
@pytest.mark.slow
def test_default_model_pp2_tp3_on_two_nodes_matches_one_process(tmp_path: Path) -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads allow TP=3; 30 layers split 19 + 11 (the head)."""
    flags = ["--max-model-len", "256", "--kv-cache-memory", "32MiB", "--device", "cpu",
             "--dtype", "float32"]  # bfloat16 rounds differently once TP splits the sums
    model = default_gguf_path()
    alone = _generate_alone(model, tmp_path, *flags)
    assert _generate_on_nodes(model, tmp_path, 2, *flags, "-pp", "2", "-tp", "3") == alone


def test_a_missing_node_fails_fast_naming_it(llama4: Path, tmp_path: Path) -> None:
    """Node 0 alone waits for node 1 and names it; node 1 alone names the master it missed."""
    port = str(free_port())
    common = [*TINY_FLAGS, "-pp", "2", "--nnodes", "2", "--master-port", port,
              "--rendezvous-timeout", "3"]
    expected = {
        "0": f"node rank 1 (rank 1) did not join the rendezvous at 127.0.0.1:{port} within 3s "
             f"(--nnodes 2)",
        "1": f"node rank 1 cannot reach node rank 0 at --master-addr 127.0.0.1 --master-port "
             f"{port} within 3s"}
    for node_rank, line in expected.items():
        node = start_engine("serve", llama4, tmp_path / f"alone{node_rank}.log", *common,
                            "--node-rank", node_rank, "--port", str(free_port()))
        try:
            assert node.wait(60) == 2, node.log
            assert node.error_line() == f"kvasir-engine: error: {line}"
        finally:
            node.stop()


def test_a_node_with_another_config_fails_every_node(llama4: Path, tmp_path: Path) -> None:
    nodes = start_nodes("serve", llama4, tmp_path, 2, *TINY_FLAGS, "-pp", "2", "--port",
                        str(free_port()), node_flags={1: ["--max-model-len", "64"]})
    try:
        assert [n.wait(60) for n in nodes] == [2, 2], [n.log for n in nodes]
        for n, (other, theirs, mine) in zip(nodes, [(1, 64, 128), (0, 128, 64)], strict=True):
            assert n.error_line().startswith(
                f"kvasir-engine: error: node rank {other} was started with another "
                f"configuration than node rank {1 - other}: model.max_model_len is {theirs} "
                f"there, {mine} here"), n.log
    finally:
        for n in nodes:
            n.stop()


def test_a_worker_rank_dead_at_start_fails_every_node(llama4: Path, tmp_path: Path) -> None:
    # No native kernels: a rank killed while it loads them would leave torch's build lock in
    # the shared kernel cache behind, and every later engine would wait on it.
    nodes = start_nodes("serve", llama4, tmp_path, 2, *TINY_FLAGS, "-pp", "2", "--port",
                        str(free_port()), env={"KVASIR_NATIVE_CPU_KERNELS": "0"})
    try:
        deadline = time.monotonic() + 60
        while not (ranks := _rank_pids(nodes[1].proc.pid)):  # killed while it imports torch
            assert time.monotonic() < deadline and nodes[1].proc.poll() is None, nodes[1].log
            time.sleep(0.02)
        os.kill(ranks[0], signal.SIGKILL)
        assert [n.wait(60) for n in nodes] == [2, 2], [n.log for n in nodes]
        for n in nodes:
            assert n.error_line() == (
                f"kvasir-engine: error: rank 1 (stage 1, tensor-parallel rank 0, node rank 1) "
                f"(pid {ranks[0]}) died with exit code -9; the engine cannot continue"), n.log
    finally:
        for n in nodes:
            n.stop()


def _rank_pids(pid: int) -> list[int]:
    """A node's spawned rank processes (not multiprocessing's resource tracker)."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return sorted(p for p in pids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())


def _serve_on_two_nodes(model: Path, tmp_path: Path, *flags: str) -> tuple[list[Node], str]:
    port = free_port()
    nodes = start_nodes("serve", model, tmp_path, 2, *TINY_FLAGS, "-pp", "2", "--host",
                        "127.0.0.1", "--port", str(port), "--served-model-name", "test", *flags)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(nodes[0], base_url)
    except AssertionError:
        for n in nodes:
            n.stop()
        raise
    body = {"model": "test", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
    return nodes, base_url


def test_a_dead_worker_rank_makes_the_leader_answer_503_and_exit(llama4: Path,
                                                                 tmp_path: Path) -> None:
    nodes, base_url = _serve_on_two_nodes(llama4, tmp_path)
    leader, worker = nodes
    try:
        (rank,) = _rank_pids(worker.proc.pid)
        os.kill(rank, signal.SIGKILL)
        seen = _health_until_exit(leader, base_url)
        assert leader.wait(EXIT_BOUND_S) != 0, leader.log
        assert 503 in [code for _, code, _ in seen], seen
        assert worker.wait(EXIT_BOUND_S) == 1, worker.log
        for n in nodes:  # every node names the dead rank
            assert "rank 1 (stage 1, tensor-parallel rank 0, node rank 1)" in n.log, n.log
            assert "died with exit code -9" in n.log, n.log
    finally:
        for n in nodes:
            n.stop()


def _master_port(node: Node) -> str:
    args = node.proc.args
    assert isinstance(args, list)
    return str(args[args.index("--master-port") + 1])


def _health_until_exit(leader: Node, base_url: str) -> list[tuple[float, int, str]]:
    """(monotonic time, status, reason) of every /health answer until the leader exits."""
    seen: list[tuple[float, int, str]] = []
    deadline = time.monotonic() + EXIT_BOUND_S
    while leader.proc.poll() is None and time.monotonic() < deadline:
        try:
            answer = httpx.get(f"{base_url}/health", timeout=2)
            seen.append((time.monotonic(), answer.status_code, answer.json().get("reason", "")))
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.05)
    return seen


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_vanished_worker_node_makes_the_idle_leader_answer_503_and_exit(
        llama4: Path, tmp_path: Path, sig: signal.Signals) -> None:
    nodes, base_url = _serve_on_two_nodes(llama4, tmp_path, "--node-heartbeat-timeout",
                                          str(HEARTBEAT_TIMEOUT_S))
    leader, worker = nodes
    silence = f"node rank 1 (rank 1) sent no heartbeat for {HEARTBEAT_TIMEOUT_S}s"
    try:
        assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200
        worker.signal_all(sig)  # the engine is idle: no request runs, none will come
        vanished = time.monotonic()
        seen = _health_until_exit(leader, base_url)
        assert leader.wait(EXIT_BOUND_S) == 1, leader.log
        unhealthy = [(t, reason) for t, code, reason in seen if code == 503]
        assert unhealthy, seen
        print(f"{sig.name}: /health 503 {unhealthy[0][0] - vanished:.2f}s after the worker "
              f"node vanished (--node-heartbeat-timeout {HEARTBEAT_TIMEOUT_S})")
        assert silence in unhealthy[0][1], unhealthy
        assert f"kvasir: {silence} (--node-heartbeat-timeout): the node is gone" in leader.log
    finally:
        for n in nodes:
            n.stop()


@pytest.mark.parametrize("how", ["killed", "killed-whole", "frozen-whole"])
def test_a_dead_leader_ends_the_worker_node(llama4: Path, tmp_path: Path, how: str) -> None:
    """The leader's process alone killed (its store's socket closes), or its every process
    killed, or frozen (no socket closes: only its missing heartbeat tells)."""
    nodes, _ = _serve_on_two_nodes(llama4, tmp_path, "--node-heartbeat-timeout",
                                   str(HEARTBEAT_TIMEOUT_S))
    leader, worker = nodes
    try:
        worker_ranks = _rank_pids(worker.proc.pid)
        if how == "killed":
            leader.proc.kill()
        else:
            leader.signal_all(signal.SIGKILL if how == "killed-whole" else signal.SIGSTOP)
        vanished = time.monotonic()
        assert worker.wait(EXIT_BOUND_S) == 1, worker.log
        print(f"{how}: the worker node exited {time.monotonic() - vanished:.2f}s after the "
              f"leader vanished")
        # Killed, the leader's sockets close: the store's or a rank's, whichever breaks first.
        assert worker.error_line().startswith("kvasir-engine: error: "), worker.log
        if how == "frozen-whole":
            assert worker.error_line() == (
                f"kvasir-engine: error: the leader (node rank 0 at 127.0.0.1:{_master_port(leader)}"
                f") went away: it sent no heartbeat for {HEARTBEAT_TIMEOUT_S}s "
                f"(--node-heartbeat-timeout)"), worker.log
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() for p in worker_ranks):
            assert time.monotonic() < deadline, "a worker rank outlived its node"
            time.sleep(0.1)
    finally:
        for n in nodes:
            n.stop()
