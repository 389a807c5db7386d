"""`--batch-invariant` (issue 40): a prompt's greedy bfloat16 tokens and logprobs are the same
bits alone as beside any neighbours (other lengths, arriving at other steps), with its prompt
cut into chunks by a small step budget, or served partly from the prefix cache.

A tiny random Llama (head_dim 32, every width a multiple of 16, so this host's native kernels
take it: the bfloat16 dot products, the decode and prefill attention kernels, the fused decode
step) through `LLMEngine` as users run it. Random weights give near-flat distributions, where a
rounding difference anywhere shows in the logprobs at once. The same runs again on the forced
fallbacks: no AVX512-BF16 (oneDNN's products, no native prefill kernel) and no native kernels
at all (torch ops everywhere), so the guarantee holds on hosts without them.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import write_checkpoint
from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from kvasir_engine.kernels import choice, cpu

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


@dataclass(frozen=True)
class Answer:
    """What one request produced, compared bit for bit."""

    tokens: tuple[int, ...]
    logprobs: tuple[tuple[float, tuple[int, ...], tuple[float, ...]], ...]
    num_cached_tokens: int


def engine_for(model_dir: Path, *flags: str) -> LLMEngine:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args([str(model_dir), "--dtype", "bfloat16", "--device", "cpu",
                            "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--max-num-seqs", "16",
                            *flags])
    return LLMEngine.from_config(engine_config_from_args(ns))


def run(engine: LLMEngine, arrivals: list[tuple[int, str, list[int]]],
        drafts: list[int] | None = None) -> dict[str, Answer]:
    """Step `engine` to the end; (step, request id, prompt) arrives before that step.
    `drafts`: gets the draft tokens each step verified (speculative decoding)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    cached: dict[str, int] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt = pending.pop(0)
            engine.add_request(request_id, prompt, GREEDY)
            tokens[request_id], logprobs[request_id] = [], []
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(
                (e.logprob, e.top_token_ids, e.top_logprobs) for e in out.new_logprobs or [])
            cached[out.request_id] = out.num_cached_tokens
        if drafts is not None:
            drafts.append(engine.last_stats.num_spec_draft_tokens)
        step += 1
    return {r: Answer(tuple(tokens[r]), tuple(logprobs[r]), cached[r]) for r in tokens}


def prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(low, high))] for _ in range(count)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("invariant"), "llama", seed=11,
                            hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=512)


# The prompts under test: short; two blocks and one token, whose cached-prefix hit computes
# its last token alone; long enough to be cut into many chunks.
SUBJECTS = [prompts(1, 1, 5, 5)[0], prompts(2, 1, 33, 33)[0], prompts(3, 1, 300, 300)[0]]
# Neighbour mixes: (batch size, step budget); neighbours of 1 to 200 tokens arrive at steps
# 0 to 5, the subject at step 2.
MIXES = [(2, None), (8, "64"), (16, "32")]


def scenarios(subject: list[int], size: int, seed: int) -> list[tuple[int, str, list[int]]]:
    rng = random.Random(seed)
    neighbours = prompts(seed, size - 1, 1, 200)
    return [(rng.randint(0, 5), f"n{i}", p) for i, p in enumerate(neighbours)] + [
        (2, "subject", subject)]


def check_invariant(model_dir: Path, flags: tuple[str, ...] = (), **kernels: str | bool) -> None:
    """`flags`: more engine flags; `kernels`: what the kernel choice must be on the host as
    the test shapes it."""
    chosen = engine_for(model_dir, "--batch-invariant", *flags).runtime.kernels
    if chosen["dense_matmul"] != kernels.get("dense_matmul", chosen["dense_matmul"]):
        pytest.skip("this host has no AVX512-BF16 products")
    assert {**chosen, **kernels, "batch_invariant": True} == chosen
    for index, subject in enumerate(SUBJECTS):
        alone = run(engine_for(model_dir, "--batch-invariant", "--no-enable-prefix-caching",
                               *flags), [(0, "subject", subject)])["subject"]
        assert len(alone.tokens) == MAX_TOKENS and len(alone.logprobs) == MAX_TOKENS
        for size, budget in MIXES:
            budget_flags = ("--max-num-batched-tokens", budget) if budget else ()
            engine = engine_for(model_dir, "--batch-invariant", *budget_flags, *flags)
            batch = run(engine, scenarios(subject, size, seed=100 * index + size))
            assert batch["subject"].tokens == alone.tokens, (index, size, budget)
            assert batch["subject"].logprobs == alone.logprobs, (index, size, budget)
            # Again on the same engine: the subject's full blocks now come from the prefix
            # cache (its last token and any partial block computed over them).
            again = run(engine, [(0, "subject", subject), *[
                (step, f"m{i}", p) for i, (step, _, p) in enumerate(
                    scenarios(subject, size, seed=7 + index)[:-1])]])
            if len(subject) > 16:
                assert again["subject"].num_cached_tokens > 0
            assert again["subject"].tokens == alone.tokens, (index, size, budget, "cached")
            assert again["subject"].logprobs == alone.logprobs, (index, size, budget, "cached")


def test_native_kernels(checkpoint: Path) -> None:
    check_invariant(checkpoint, dense_matmul="native", decode_attention="native",
                    fused_decode=True)


def test_float32(checkpoint: Path) -> None:
    """float32 compute: `F.linear` products in 16-row tiles, the native decode kernel."""
    if not cpu.available():
        pytest.skip("native CPU kernels unavailable here")
    check_invariant(checkpoint, ("--dtype", "float32"), dense_matmul="torch",
                    decode_attention="native")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_native_kernels(checkpoint: Path, quantization: str) -> None:
    """The native int8/int4 products scale activations per row and sum each output alone."""
    if not cpu.available():
        pytest.skip("native CPU kernels unavailable here")
    check_invariant(checkpoint, ("--quantization", quantization), matmul="native",
                    decode_attention="native", fused_decode=True)


@pytest.mark.parametrize("native", [True, False])
def test_ngram_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(
        checkpoint: Path, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verification step scores 1 + k positions of a request as rows of their own, as plain
    decoding scores one: greedy speculation gives the plain tokens and logprobs, alone or in a
    batch, whatever was proposed and accepted."""
    if not native:
        monkeypatch.setenv("KVASIR_NATIVE_CPU_KERNELS", "0")
    spec = ("--speculative-config", json.dumps({
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "disable_by_batch_size": 16}))
    subject = [9, 10, 11, 12, 13] * 7  # repeats, so the n-grams propose
    plain = run(engine_for(checkpoint, "--batch-invariant"),
                [(0, "subject", subject)])["subject"]
    drafts: list[int] = []
    alone = run(engine_for(checkpoint, "--batch-invariant", *spec), [(0, "subject", subject)],
                drafts)["subject"]
    batch = run(engine_for(checkpoint, "--batch-invariant", "--max-num-batched-tokens", "64",
                           *spec), scenarios(subject, 8, seed=3), drafts)["subject"]
    assert sum(drafts) > 0, "the n-grams were meant to propose"
    for answer in (alone, batch):
        assert answer.tokens == plain.tokens
        assert answer.logprobs == plain.logprobs


def test_without_avx512_bf16(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's products (whose sums follow the row count) and the torch prefill path."""
    host_has = choice.cpu_has
    monkeypatch.setattr(choice, "cpu_has",
                        lambda *flags: host_has(*[f for f in flags if f != "avx512_bf16"]))
    check_invariant(checkpoint, dense_matmul="onednn", prefill_attention="matmul",
                    fused_decode=False)


def test_without_native_kernels(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_NATIVE_CPU_KERNELS", "0")
    check_invariant(checkpoint, dense_matmul="onednn", decode_attention="torch")


def test_without_native_kernels_or_onednn(checkpoint: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The barest host: `F.linear` products and torch attention."""
    monkeypatch.setenv("KVASIR_NATIVE_CPU_KERNELS", "0")
    monkeypatch.setattr(choice, "onednn_available", lambda: False)
    check_invariant(checkpoint, dense_matmul="torch", decode_attention="torch")


@pytest.mark.parametrize("native", [True, False])
def test_an_interjected_first_token_changes_nothing(checkpoint: Path, native: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A newcomer's first token computed between two layers of the step in flight (its own
    plan, the server's engine thread's way; docs/tenancy.md): its tokens and logprobs, and the
    step's own requests', are those each gets alone."""
    if not native:
        monkeypatch.setenv("KVASIR_NATIVE_CPU_KERNELS", "0")
    heavy = {f"h{i}": p for i, p in enumerate(prompts(21, 4, 20, 60))}
    light = prompts(22, 1, 40, 40)[0]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args([str(checkpoint), "--dtype", "bfloat16", "--device", "cpu",
                            "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                            "--max-num-seqs", "5", "--batch-invariant"])
    config = engine_config_from_args(ns)
    assert config.scheduler.interject_first_tokens
    engine = LLMEngine.from_config(config)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}

    def take(outputs: list) -> None:
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(
                (e.logprob, e.top_token_ids, e.top_logprobs) for e in out.new_logprobs or [])

    for request_id, prompt in list(heavy.items())[:3]:
        engine.add_request(request_id, prompt, GREEDY, tenant_id="heavy")
    take(engine.step())
    # A prompt in the step in flight, so it runs a layer at a time (a decode-only step may be
    # the fused call, which has no point between layers).
    engine.add_request("h3", heavy["h3"], GREEDY, tenant_id="heavy")
    step = engine.begin_step()
    interjected = []
    while step.advance():
        if not interjected:
            engine.add_request("light", light, GREEDY, tenant_id="light")
        interjected.append(engine.interject())
    take(engine.end_step(step))
    assert interjected[0] is not None and [o.request_id for o in interjected[0]] == ["light"]
    take(interjected[0])
    while engine.has_unfinished_requests():
        take(engine.step())
    for request_id, prompt in [*heavy.items(), ("light", light)]:
        single = run(engine_for(checkpoint, "--batch-invariant"),
                     [(0, request_id, prompt)])[request_id]
        assert tuple(tokens[request_id]) == single.tokens, request_id
        assert tuple(logprobs[request_id]) == single.logprobs, request_id
