"""Speculative decoding through the whole engine, on tiny random checkpoints (float32, CPU).

Greedy and seeded outputs must be token-identical with and without speculation (a seeded row
draws the same numbers at each verified position as it would one step at a time,
spec_decode/rejection.py), under continuous batching with requests with and without drafts,
chunked prefill, prefix caching and preemption; and every KV block must come back.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from test_end_to_end import BLOCK_BYTES, engine_for

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1, "disable_by_batch_size": 64})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=7)


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (n-gram lookup proposes) and ones that do not."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, 380) for _ in range(rng.randint(2, 6))]
        prompts.append(phrase * rng.randint(2, 8) if i % 3 else
                       [rng.randrange(3, 380) for _ in range(rng.randint(3, 40))])
    return prompts


def run(engine: LLMEngine, prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams]) -> tuple[list[list[int]], dict[str, int]]:
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt, sp in zip(ids, prompts, per_prompt, strict=True):
        engine.add_request(request_id, prompt, sp)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "preemptions": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        stats = engine.last_stats
        totals["drafts"] += stats.num_spec_drafts
        totals["draft_tokens"] += stats.num_spec_draft_tokens
        totals["accepted"] += stats.num_spec_accepted_tokens
        totals["preemptions"] += stats.num_preemptions
    kv = engine.core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks, "KV blocks leaked"
    return [tokens[request_id] for request_id in ids], totals


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("flags", [
    (),
    ("--max-num-batched-tokens", "16", "--max-num-seqs", "4"),  # chunked prefill
    ("--kv-cache-memory", str(12 * BLOCK_BYTES), "--no-enable-prefix-caching"),  # preemption
], ids=["batched", "chunked", "preempting"])
def test_greedy_is_token_identical_with_ngram_speculation(checkpoint: Path,
                                                          flags: tuple[str, ...]) -> None:
    prompts = repetitive_prompts(9, seed=1)
    common = ("--max-model-len", "128", *flags)
    plain, _ = run(engine_for(checkpoint, *common), prompts, GREEDY)
    speculative, totals = run(engine_for(checkpoint, *common, "--speculative-config", NGRAM),
                              prompts, GREEDY)
    assert speculative == plain
    assert totals["accepted"] > 0 and totals["draft_tokens"] > totals["accepted"]
    if "--kv-cache-memory" in flags:
        assert totals["preemptions"] > 0, "the tiny cache was meant to force preemption"


def test_seeded_sampling_is_token_identical_with_speculation(checkpoint: Path) -> None:
    prompts = repetitive_prompts(8, seed=2)
    params = [SamplingParams(temperature=[1.0, 0.7, 1.3][i % 3], top_k=[0, 40, 5][i % 3],
                             top_p=[1.0, 0.9, 0.8][i % 3], min_p=0.02 * (i % 2),
                             presence_penalty=0.5 * (i % 2), frequency_penalty=0.3 * (i % 3 == 2),
                             repetition_penalty=1.2 if i % 4 == 0 else 1.0, min_tokens=3,
                             seed=1000 + i, max_tokens=20, logprobs=2)
              for i in range(len(prompts))]
    plain, _ = run(engine_for(checkpoint, "--max-model-len", "128"), prompts, params)
    speculative, totals = run(engine_for(checkpoint, "--max-model-len", "128",
                                         "--speculative-config", NGRAM), prompts, params)
    assert speculative == plain
    assert totals["drafts"] > 0


def test_logprobs_follow_every_emitted_token(checkpoint: Path) -> None:
    prompts = repetitive_prompts(3, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    plain = engine_for(checkpoint, "--max-model-len", "128").generate(prompts, params)
    spec_engine = engine_for(checkpoint, "--max-model-len", "128", "--speculative-config", NGRAM)
    speculative = spec_engine.generate(prompts, params)
    for a, b in zip(plain, speculative, strict=True):
        assert a.token_ids == b.token_ids
        assert b.logprobs is not None and a.logprobs is not None
        assert [e.token_id for e in b.logprobs] == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_stop_strings_and_aborts_leak_no_blocks(checkpoint: Path) -> None:
    engine = engine_for(checkpoint, "--max-model-len", "128", "--speculative-config", NGRAM)
    prompts = repetitive_prompts(6, seed=4)
    plain = engine_for(checkpoint, "--max-model-len", "128").generate(prompts, GREEDY)
    stop_text = plain[1].text[3:6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            stop=(stop_text,) if stop_text.strip() else ())
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, params)
    for step in range(40):
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        if step == 3:
            engine.abort_request(["s0", "s4"])
        for out in outputs:
            if out.request_id == "s1" and out.finish_reason is not None and stop_text.strip():
                assert stop_text not in out.text_delta
    kv = engine.core.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
