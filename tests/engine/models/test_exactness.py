"""Our Llama-family model against transformers' implementation of the same checkpoint.

Tiny random checkpoints (float32) of every supported family: logits of a ragged batch match
within 1e-4, and greedy tokens produced through the runner (chunked prefill across steps,
batched decodes over the paged cache) equal transformers' `generate`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import StepDriver, prefill_output, tiny_engine_config, write_checkpoint
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.worker.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")
FAMILIES = ["llama", "llama3", "mistral", "qwen2"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    directory = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32).eval()
    return request.param, directory, reference


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_checkpoint_is_sharded_with_index(checkpoint) -> None:  # type: ignore[no-untyped-def]
    _, directory, _ = checkpoint
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("*.safetensors"))) > 1


def test_ragged_batch_logits_match_transformers(checkpoint) -> None:  # type: ignore[no-untyped-def]
    family, directory, reference = checkpoint
    runner = ModelRunner(tiny_engine_config(directory))
    runner.initialize_kv_cache()
    if family == "llama3":
        assert runner.arch.rope_scaling.rope_type == "llama3"
    if family == "qwen2":
        assert runner.arch.attention_bias and runner.arch.tie_word_embeddings
    prompts = _prompts(runner.arch.vocab_size, [5, 17, 1, 33])
    so = prefill_output(prompts, 4, GREEDY)
    runner.update_states(so)
    logits = runner.compute_logits(runner.prepare(so))
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1 << 30, 5])
def test_greedy_generation_matches_transformers(checkpoint, chunk: int) -> None:  # type: ignore[no-untyped-def]
    _, directory, reference = checkpoint
    runner = ModelRunner(tiny_engine_config(directory))
    runner.initialize_kv_cache()
    prompts = _prompts(runner.arch.vocab_size, [3, 11, 7, 20], seed=1)
    ids = {f"r{i}": p for i, p in enumerate(prompts)}
    ours = StepDriver(runner, 4).generate(ids, dict.fromkeys(ids, GREEDY), max_tokens=12,
                                          chunk=chunk)
    for req_id, prompt in ids.items():
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     min_new_tokens=12, pad_token_id=0)
        assert ours[req_id] == out[0, len(prompt):].tolist(), req_id
