"""Tensor parallelism on CPU over gloo: tp=2 must give tp=1's greedy tokens with half the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import default_gguf_path, write_checkpoint
from kvasir_engine.worker.executor import UniprocExecutor
from kvasir_engine.worker.multiproc_executor import MultiprocExecutor
from tp_driver import check_killed_rank_stops, greedy_generate, make_config

PROMPTS = [[5, 17, 33, 2, 91, 8, 14], [44] * 3, list(range(10, 40))]


def run(config, prompts, max_tokens):  # type: ignore[no-untyped-def]
    executor = UniprocExecutor(config) if config.parallel.tensor_parallel_size == 1 \
        else MultiprocExecutor(config)
    try:
        executor.initialize()
        tokens = greedy_generate(executor, prompts, max_tokens, config.cache.block_size)
        weights = getattr(executor, "rank_weight_bytes", None) or [
            sum(p.numel() * p.element_size() for p in executor.runner.model.parameters())]
        return tokens, weights
    finally:
        executor.shutdown()


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # 1: the KV head is replicated on both ranks
def test_tp2_matches_tp1_on_tiny_llama(tmp_path: Path, num_kv_heads: int) -> None:
    model = write_checkpoint(tmp_path / "llama", "llama", num_key_value_heads=num_kv_heads,
                             hidden_size=128, intermediate_size=256)
    tokens1, (weights1,) = run(make_config(model, 1), PROMPTS, 12)
    tokens2, weights2 = run(make_config(model, 2), PROMPTS, 12)
    assert tokens2 == tokens1
    assert all(len(t) == 12 for t in tokens1)
    # Norm weights are replicated; everything else is split: a bit over half per rank.
    assert len(weights2) == 2 and weights2[0] == weights2[1]
    assert 0.5 <= weights2[0] / weights1 < 0.56


@pytest.mark.slow  # four loads of the 135M GGUF on two cores: about a minute, more under load
def test_tp3_matches_tp1_on_default_model() -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads, so 3 is its smallest tensor-parallel size."""
    model = default_gguf_path()
    prompts = [[1, 9690, 198, 2683, 314, 253], [504, 3458, 282]]
    tokens1, (weights1,) = run(make_config(model, 1, kv_bytes=32 << 20), prompts, 6)
    tokens3, weights3 = run(make_config(model, 3, kv_bytes=32 << 20), prompts, 6)
    assert tokens3 == tokens1
    assert max(weights3) / weights1 < 0.4


def test_tp_size_that_does_not_fit_fails_at_start() -> None:
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        make_config(default_gguf_path(), 2)


def test_rank_error_at_start_is_reported(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "llama", "llama")
    executor = MultiprocExecutor(make_config(model, 2, kv_bytes=1024))
    # Every rank fails the same way; whichever reports first names itself.
    with pytest.raises(ValueError, match=r"rank [01] .*: ValueError: KV cache budget"):
        executor.initialize()
    executor.shutdown()
    assert not executor.is_healthy


def test_killed_rank_stops_the_executor(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "llama", "llama")
    check_killed_rank_stops(make_config(model, 2), 1, "tensor-parallel rank 1")
