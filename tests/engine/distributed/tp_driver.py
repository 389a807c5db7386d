"""A minimal greedy driver for executors: hand-built SchedulerOutputs, no scheduler needed.

Request i prefills its whole prompt in the first step (its blocks allocated up front), then
decodes one token per step, which is exactly the plain data the engine core sends.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from kvasir_engine.checkpoint.metadata import read_model_arch
from kvasir_engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvasir_engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.worker.multiproc_executor import MultiprocExecutor


def make_config(model: Path, tp_size: int, max_model_len: int = 128, block_size: int = 16,
                kv_bytes: int = 8 << 20, pp_size: int = 1,
                micro_batches: int | None = None) -> EngineConfig:
    arch = read_model_arch(model)
    return EngineConfig(
        model=ModelConfig(model=str(model), arch=arch, served_model_name="m", dtype="float32",
                          max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_bytes),
        scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_seqs=8,
                                  max_num_batched_tokens=512),
        parallel=ParallelConfig(tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size,
                                pipeline_micro_batches=micro_batches, rendezvous_timeout_s=60),
        device=DeviceConfig(device="cpu", attention_backend="torch"),
    )


def greedy_generate(executor: Any, prompts: list[list[int]], max_tokens: int,
                    block_size: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    next_block, new_reqs = 1, []
    for req_id, prompt in zip(ids, prompts, strict=True):
        num_blocks = -(-(len(prompt) + max_tokens) // block_size)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        new_reqs.append(NewRequestData(req_id, list(prompt), len(prompt), params, blocks, 0))
    lengths = {r: len(p) for r, p in zip(ids, prompts, strict=True)}
    so = SchedulerOutput(new_reqs, [], dict(lengths), sum(lengths.values()))
    outputs: dict[str, list[int]] = {r: [] for r in ids}
    for _ in range(max_tokens):
        result = executor.execute_model(so)
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids, strict=True):
            outputs[req_id] += tokens
        cached = [CachedRequestData(r, [], lengths[r] + len(outputs[r]) - 1) for r in ids]
        so = SchedulerOutput([], cached, dict.fromkeys(ids, 1), len(ids))
    return [outputs[r] for r in ids]


def check_killed_rank_stops(config: EngineConfig, rank: int, named: str) -> None:
    """SIGKILL local rank `rank` between steps: the watchdog reports it at once (`named` in the
    message), every rank is gone, and the next step raises."""
    failed = threading.Event()
    messages: list[str] = []

    def on_failure(message: str) -> None:
        messages.append(message)
        failed.set()

    executor = MultiprocExecutor(config, on_rank_failure=on_failure)
    try:
        executor.initialize()
        assert greedy_generate(executor, [[5, 17, 33, 2]], 2, 16)[0]
        os.kill(executor.procs[rank].pid, signal.SIGKILL)
        # The watchdog notices between steps; the bound only keeps a broken build from hanging.
        assert failed.wait(timeout=30)
        assert named in messages[0] and "exit code -9" in messages[0], messages
        assert not executor.is_healthy
        assert not any(p.is_alive() for p in executor.procs)
        with pytest.raises(RuntimeError, match=f"rank {rank} .* died"):
            greedy_generate(executor, [[5, 17, 33, 2]], 2, 16)
    finally:
        executor.shutdown()
