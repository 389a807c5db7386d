"""Decode CUDA graphs: the ladder and padding on CPU; capture and replay vs eager on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import REQUIRES_CUDA
from kvasir_engine.worker.cuda_graphs import capture_sizes, graphs_enabled, padded_batch_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]


@pytest.mark.parametrize(("num_reqs", "expected"), [(1, 1), (3, 4), (5, 8), (17, 20), (20, 20),
                                                    (21, None)])
def test_padded_batch_size(num_reqs: int, expected: int | None) -> None:
    assert padded_batch_size(num_reqs, capture_sizes(20)) == expected


def test_graphs_only_on_cuda_with_triton_and_not_eager() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graphs_enabled(cuda, "triton", enforce_eager=False)
    assert not graphs_enabled(cuda, "triton", enforce_eager=True)
    assert not graphs_enabled(cuda, "torch", enforce_eager=False)
    assert not graphs_enabled(cpu, "triton", enforce_eager=False)


@pytest.mark.parametrize("num_reqs", [1, 3, 9])
@pytest.mark.gpu
@REQUIRES_CUDA
def test_graph_replay_matches_eager_decode(tmp_path: Path, num_reqs: int) -> None:
    from helpers import write_checkpoint
    from kvasir_engine.config import DeviceConfig, EngineConfig
    from kvasir_engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from kvasir_engine.core.request import SamplingParams
    from kvasir_engine.worker.cuda_graphs import DecodeCUDAGraphs
    from kvasir_engine.worker.model_runner import ModelRunner
    from tp_driver import make_config

    base = make_config(write_checkpoint(tmp_path / "m", "llama"), 1)
    config = EngineConfig(base.model, base.cache, base.scheduler, base.parallel,
                          DeviceConfig(device="cuda", attention_backend="triton",
                                       enforce_eager=True))
    runner = ModelRunner(config)
    runner.initialize_kv_cache()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = [f"r{i}" for i in range(num_reqs)]
    prompts = [[3 + i] * (5 + 7 * i) for i in range(num_reqs)]
    new = [NewRequestData(r, p, len(p), params, [1 + 8 * i + b for b in range(8)], 0)
           for i, (r, p) in enumerate(zip(ids, prompts, strict=True))]
    runner.execute_model(SchedulerOutput(new, [], {r: len(p) for r, p in zip(ids, prompts,
                                                                              strict=True)},
                                         sum(map(len, prompts))))
    so = SchedulerOutput([], [CachedRequestData(r, [], len(p)) for r, p in zip(ids, prompts,
                                                                                 strict=True)],
                         dict.fromkeys(ids, 1), num_reqs)
    runner.update_states(so)
    batch = runner.prepare(so)
    with torch.inference_mode():
        eager = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
    graphs = DecodeCUDAGraphs(
        lambda i, p, m: runner.model(i, p, runner.kv_caches, m), config.scheduler.max_num_seqs,
        config.model.max_model_len, config.cache.block_size, config.model.arch.hidden_size,
        runner.dtype, runner.device)
    graphs.capture()
    assert graphs.can_run(batch.meta)
    replayed = graphs.run(batch.input_ids, batch.positions, batch.meta)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


def _runner_config(model: Path, device: str, enforce_eager: bool):  # type: ignore[no-untyped-def]
    from kvasir_engine.config import DeviceConfig, EngineConfig
    from tp_driver import make_config

    base = make_config(model, 1)
    backend = "triton" if device == "cuda" else "torch"
    return EngineConfig(base.model, base.cache, base.scheduler, base.parallel,
                        DeviceConfig(device=device, attention_backend=backend,
                                     enforce_eager=enforce_eager))


def _greedy(config, prompts: list[list[int]]):  # type: ignore[no-untyped-def]
    """(tokens, the runner's graphs, decode steps replayed from a graph)."""
    from kvasir_engine.worker.executor import UniprocExecutor
    from tp_driver import greedy_generate

    executor = UniprocExecutor(config)
    try:
        executor.initialize()
        runner = executor.runner
        assert runner is not None
        replays = [0]
        if runner.graphs is not None:
            run = runner.graphs.run

            def counting_run(*args):  # type: ignore[no-untyped-def]
                replays[0] += 1
                return run(*args)

            runner.graphs.run = counting_run  # type: ignore[method-assign]
        tokens = greedy_generate(executor, prompts, 6, config.cache.block_size)
        return tokens, runner.graphs, replays[0]
    finally:
        executor.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_runner_on_cpu_never_builds_graphs(tmp_path: Path, enforce_eager: bool) -> None:
    from helpers import write_checkpoint

    config = _runner_config(write_checkpoint(tmp_path / "m", "llama"), "cpu", enforce_eager)
    tokens, graphs, replays = _greedy(config, [[5, 6, 7], [9] * 11])
    assert graphs is None and replays == 0
    assert [len(t) for t in tokens] == [6, 6]


@pytest.mark.gpu
@REQUIRES_CUDA
def test_runner_graph_decode_gives_the_eager_tokens(tmp_path: Path) -> None:
    from helpers import write_checkpoint

    model = write_checkpoint(tmp_path / "m", "llama")
    prompts = [[3 + i] * (5 + 7 * i) for i in range(3)]
    eager, no_graphs, _ = _greedy(_runner_config(model, "cuda", True), prompts)
    replayed, graphs, replays = _greedy(_runner_config(model, "cuda", False), prompts)
    assert no_graphs is None
    assert graphs is not None and set(graphs.graphs) == set(graphs.sizes)
    assert replays == 5  # every decode step after the prefill step
    assert replayed == eager
