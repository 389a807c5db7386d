"""kernels/host.py's `cpu_threads`: OMP_NUM_THREADS honoured, the cgroup's CPU quota respected.

Two engines of the default model on a 2-core host, each started with OMP_NUM_THREADS=1 while the
engine set its pool to every CPU anyway, ran 10-20x slower than one alone (bench/gateway.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.kernels import host
from processes import TINY_FLAGS, free_port, start_engine, wait_ready


@pytest.fixture
def sixty_four_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # The `os` module itself: worker/rank.py reads the same affinity mask.
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(64)))


def cgroup(tmp_path: Path, cpu_max: str | None = None,
           v1: tuple[str, str] | None = None) -> Path:
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    return tmp_path


@pytest.mark.usefixtures("sixty_four_cpus")
@pytest.mark.parametrize("env, cpu_max, expected, why", [
    ({"OMP_NUM_THREADS": "1"}, None, 1, "OMP_NUM_THREADS=1"),
    ({"OMP_NUM_THREADS": "3,2"}, "max 100000", 3, "OMP_NUM_THREADS=3,2"),
    ({"OMP_NUM_THREADS": "100"}, None, 64, "capped at the affinity"),
    ({"OMP_NUM_THREADS": "many"}, None, 64, "affinity mask"),
    ({"OMP_NUM_THREADS": "0"}, "150000 100000", 2, "quota"),
    ({}, "400000 100000", 4, "quota"),
    ({}, "max 100000", 64, "affinity mask"),
    ({}, "6400000 100000", 64, "affinity mask"),
    ({}, None, 64, "affinity mask"),
])
def test_threads_follow_omp_num_threads_then_the_quota(tmp_path: Path, env: dict[str, str],
                                                       cpu_max: str | None, expected: int,
                                                       why: str) -> None:
    count, reason = host.cpu_threads(env, cgroup(tmp_path, cpu_max))
    assert count == expected and why in reason


@pytest.mark.usefixtures("sixty_four_cpus")
@pytest.mark.parametrize("quota, period, expected", [
    ("250000", "100000", 3), ("-1", "100000", 64), ("50000", "100000", 1)])
def test_cgroup_v1_quota(tmp_path: Path, quota: str, period: str, expected: int) -> None:
    assert host.cpu_threads({}, cgroup(tmp_path, v1=(quota, period)))[0] == expected


def test_the_engine_process_runs_the_threads_omp_num_threads_asks_for(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=2, hidden_size=64,
                             intermediate_size=128)
    port = free_port()
    node = start_engine("serve", model, tmp_path / "engine.log", *TINY_FLAGS, "--host",
                        "127.0.0.1", "--port", str(port), env={"OMP_NUM_THREADS": "1"})
    try:
        wait_ready(node, f"http://127.0.0.1:{port}")
        assert "CPU threads: 1 (OMP_NUM_THREADS=1)" in node.log
    finally:
        node.stop()


@pytest.mark.usefixtures("sixty_four_cpus")
@pytest.mark.parametrize("env, ranks, expected", [
    ({"OMP_NUM_THREADS": "4"}, 2, [(0, 1), (2, 3)]),  # the ranks share the budget
    ({}, 2, [tuple(range(32)), tuple(range(32, 64))]),  # no budget set: every core, split
    ({"OMP_NUM_THREADS": "1"}, 2, [(0,), (0,)]),  # fewer cores than ranks: they share one
])
def test_tensor_parallel_ranks_split_the_thread_budget(monkeypatch: pytest.MonkeyPatch,
                                                       env: dict[str, str], ranks: int,
                                                       expected: list[tuple[int, ...]]) -> None:
    from kvasir_engine.worker import rank

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(host, "_cgroup_cpu_quota", lambda root: None)
    assert [rank.cpu_ids(i, ranks) for i in range(ranks)] == expected
