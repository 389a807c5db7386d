"""The whole engine against `transformers`: greedy generations must be token-identical.

Tiny random Llama / Llama-3 / Mistral / Qwen2 checkpoints written by the tests (float32), run
through `LLMEngine` as users run it: a batch of mixed prompt lengths, chunked prefill, prefix-cache
hits, and preemption forced by a deliberately tiny KV cache. The reference is a plain greedy loop
over the transformers model (full forward each step, no cache), one prompt at a time.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import write_checkpoint
from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine

MAX_TOKENS = 20
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K+V x layers x kv heads x head_dim x fp32 x block_size


def engine_for(model_dir: Path, *flags: str) -> LLMEngine:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args([str(model_dir), "--dtype", "float32", "--device", "cpu", *flags])
    return LLMEngine.from_config(engine_config_from_args(ns))


def reference_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outputs.append(ids[len(prompt):])
    return outputs


def mixed_prompts(count: int, seed: int, low: int = 3, high: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(low, high))] for _ in range(count)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class StepRun:
    """What stepping an engine to the end showed: tokens per prompt and scheduler counters."""

    tokens: list[list[int]]
    num_preemptions: int
    num_prefix_hit_tokens: int


def step_to_end(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> StepRun:
    """Like `LLMEngine.generate`, but step by step so the per-step scheduler stats are summed."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    preemptions = hits = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        preemptions += engine.last_stats.num_preemptions
        hits += engine.last_stats.prefix_cache_hits
    return StepRun([tokens[request_id] for request_id in ids], preemptions, hits)


@pytest.fixture(scope="module", params=["llama", "llama3", "mistral", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=7)


@pytest.fixture(scope="module")
def prompts_and_reference(checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = mixed_prompts(8, seed=1)
    return prompts, reference_greedy(checkpoint, prompts, MAX_TOKENS)


def test_mixed_batch_matches_transformers(checkpoint, prompts_and_reference) -> None:
    prompts, expected = prompts_and_reference
    engine = engine_for(checkpoint, "--max-model-len", "128")
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)


def test_chunked_prefill_matches_transformers(checkpoint, prompts_and_reference) -> None:
    prompts, expected = prompts_and_reference
    # A 16-token budget cuts every long prompt into chunks that interleave with other decodes.
    engine = engine_for(checkpoint, "--max-model-len", "128", "--max-num-batched-tokens", "16",
                        "--max-num-seqs", "4")
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected


def test_prefix_cache_hits_match_transformers(checkpoint) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(3, 380) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 380) for _ in range(rng.randint(1, 20))]
               for _ in range(4)]
    expected = reference_greedy(checkpoint, prompts, MAX_TOKENS)
    engine = engine_for(checkpoint, "--max-model-len", "128")
    first = engine.generate(prompts[:1], GREEDY)
    rest = engine.generate(prompts[1:], GREEDY)
    assert [r.token_ids for r in first + rest] == expected
    # 40 shared tokens = 2 full blocks of 16, served from the cache for every later prompt.
    assert all(r.num_cached_tokens == 32 for r in rest)
    assert first[0].num_cached_tokens == 0


def test_preemption_under_tiny_cache_matches_transformers(checkpoint, prompts_and_reference) -> None:
    prompts, expected = prompts_and_reference
    # 9 blocks: one 128-token sequence fits, eight requests of up to 90 tokens do not.
    engine = engine_for(checkpoint, "--max-model-len", "128",
                        "--kv-cache-memory", str(9 * BLOCK_BYTES), "--no-enable-prefix-caching")
    run = step_to_end(engine, prompts, GREEDY)
    assert run.num_preemptions > 0, "the tiny cache was meant to force preemption"
    assert run.tokens == expected
    assert engine.core.scheduler.kv_cache_manager.usage == 0.0
