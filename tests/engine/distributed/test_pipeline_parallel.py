"""Pipeline parallelism on CPU over gloo: stages of contiguous layers, hidden states handed on
point to point; PP=2 (and PP=2 x TP=2) must give PP=1's greedy tokens, each stage holding only
its part of the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.checkpoint.metadata import read_model_arch
from kvasir_engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.models.pipeline_stage import split_layers, stage_for
from kvasir_engine.worker.executor import UniprocExecutor
from kvasir_engine.worker.multiproc_executor import MultiprocExecutor
from kvasir_engine.worker.pipeline import split_plan
from tp_driver import check_killed_rank_stops, greedy_generate, make_config

PROMPTS = [[5, 17, 33, 2, 91, 8, 14], [44] * 3, list(range(10, 40)), [7, 7, 100]]


def run(config, prompts, max_tokens):  # type: ignore[no-untyped-def]
    executor = (UniprocExecutor(config) if config.parallel.world_size == 1
                else MultiprocExecutor(config))
    try:
        executor.initialize()
        tokens = greedy_generate(executor, prompts, max_tokens, config.cache.block_size)
        weights = getattr(executor, "rank_weight_bytes", None) or [
            sum(p.numel() * p.element_size() for p in executor.runner.model.parameters())]
    finally:
        executor.shutdown()
    return tokens, weights, getattr(executor, "pipeline_stats", [])


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("pp") / "llama", "llama",
                            num_hidden_layers=4, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def reference(llama4: Path) -> list[list[int]]:
    tokens, _, _ = run(make_config(llama4, 1), PROMPTS, 10)
    assert all(len(t) == 10 for t in tokens)
    return tokens


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_pp2_matches_pp1(llama4: Path, reference: list[list[int]], micro_batches: int) -> None:
    tokens, weights, stats = run(make_config(llama4, 1, pp_size=2, micro_batches=micro_batches),
                                 PROMPTS, 10)
    assert tokens == reference
    assert len(weights) == 2
    # Each stage holds its layers (and the embedding or the head): well under the whole.
    whole = run(make_config(llama4, 1), PROMPTS[:1], 1)[1][0]
    assert max(weights) < 0.8 * whole and sum(weights) == pytest.approx(whole, rel=0.01)
    # Every step, stage 0 handed stage 1 a hidden state and a residual per token.
    first = next(s for s in stats if s.pp_rank == 0)
    hidden = read_model_arch(llama4).hidden_size
    assert first.num_steps == 10
    assert first.num_sent_tokens == sum(map(len, PROMPTS)) + 9 * len(PROMPTS)
    assert first.sent_bytes == first.num_sent_tokens * 2 * hidden * 4
    assert all(0.0 <= s.bubble < 1.0 for s in stats)


def test_pp2_tp2_matches_pp1(llama4: Path, reference: list[list[int]]) -> None:
    tokens, weights, stats = run(make_config(llama4, 2, pp_size=2), PROMPTS, 10)
    assert tokens == reference
    assert len(weights) == 4 and len(stats) == 4


def test_pp4_one_layer_per_stage(llama4: Path, reference: list[list[int]]) -> None:
    tokens, _, stats = run(make_config(llama4, 1, pp_size=4), PROMPTS[:2], 10)
    assert tokens == reference[:2]
    assert sorted(s.pp_rank for s in stats) == [0, 1, 2, 3]


def test_tied_embeddings_on_the_last_stage(tmp_path: Path) -> None:
    """The last stage holds the tied LM head without the embedding: its own loaded copy."""
    model = write_checkpoint(tmp_path / "tied", "llama", num_hidden_layers=2,
                             tie_word_embeddings=True)
    one, _, _ = run(make_config(model, 1), PROMPTS[:2], 8)
    two, _, _ = run(make_config(model, 1, pp_size=2), PROMPTS[:2], 8)
    assert two == one


def test_more_stages_than_layers_fails_at_start(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 exceeds the model's 2 layers"):
        make_config(model, 1, pp_size=3)


def test_layers_split_by_compute_with_the_head_on_the_last_stage() -> None:
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    # SmolLM2-135M: the LM head is ~8 layers of compute, so the last stage gets fewer layers.
    assert split_layers(30, 2, head_cost=8.0) == [(0, 19), (19, 30)]
    assert split_layers(4, 4, head_cost=8.0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_layers(5, 3) == [(0, 2), (2, 3), (3, 5)]


def test_stage_owns_its_weights(llama4: Path) -> None:
    arch = read_model_arch(llama4)
    first, last = stage_for(arch, 0, 2), stage_for(arch, 1, 2)
    assert first.owns_weight("model.embed_tokens.weight")
    assert not last.owns_weight("model.embed_tokens.weight")
    assert last.owns_weight("lm_head.weight") and last.owns_weight("model.norm.weight")
    assert first.end_layer == last.start_layer
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(arch.num_hidden_layers)]
    assert [first.owns_weight(n) for n in names] != [last.owns_weight(n) for n in names]


def test_split_plan_partitions_the_step() -> None:
    params = SamplingParams()
    new = [NewRequestData(f"n{i}", [1, 2, 3], 3, params, [1], 0) for i in range(2)]
    cached = [CachedRequestData(f"c{i}", [i], 5) for i in range(3)]
    so = SchedulerOutput(new, cached, {"n0": 3, "n1": 3, "c0": 1, "c1": 1, "c2": 1}, 9, {"gone"})
    parts = split_plan(so, 2)
    assert [list(p.num_scheduled_tokens) for p in parts] == [["n0", "n1"], ["c0", "c1", "c2"]]
    assert [p.total_num_scheduled_tokens for p in parts] == [6, 3]
    assert parts[0].finished_req_ids == {"gone"} and parts[1].finished_req_ids == set()
    assert split_plan(so, 1) == [so]


def test_rank_error_at_start_names_the_rank(llama4: Path) -> None:
    executor = MultiprocExecutor(make_config(llama4, 1, pp_size=2, kv_bytes=1024))
    with pytest.raises(ValueError, match=r"rank [01] \(stage [01], .*KV cache budget"):
        executor.initialize()
    executor.shutdown()
    assert not executor.is_healthy


def test_killed_last_stage_stops_the_executor(llama4: Path) -> None:
    check_killed_rank_stops(make_config(llama4, 1, pp_size=2), 1, "rank 1 (stage 1")
