"""Issue 36's acceptance: weight-only checkpoints of the default model (SmolLM2-135M, its Q4_1
GGUF exported to bfloat16 and quantized by compressed-tensors itself, as bench/quality.py
does) give, in float32, greedy text equal to the library's dequantized reference (transformers,
float32, `ct_checkpoints.reference_greedy`) for DEFAULT_MODEL_PROMPTS and one chat-templated
question (an instruct model's usual input), MAX_TOKENS new tokens each.

Our weight-only kernels multiply the very weights the library dequantizes to, with float
activations; only the order of float32 sums differs, so a continuation may part from the
reference only where its top two logits tie to that order's rounding. A failure prints the
first diverging position and the reference's top-2 logit gap there to tell the two apart.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from ct_checkpoints import (
    DEFAULT_MODEL_PROMPTS,
    export_default_bf16,
    quantize_export,
    reference_greedy,
    reference_model,
)
from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from kvasir_engine.kernels import cpu

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable")

MAX_TOKENS = 32
CHAT = [{"role": "user", "content": "Name three rivers in Europe and say where each begins."}]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_default_bf16(tmp_path_factory.mktemp("default") / "bf16")


def _divergence(reference, prompt: list[int], ours: list[int],  # type: ignore[no-untyped-def]
                theirs: list[int]) -> str:
    """Where two continuations part, and the reference's top-2 logit gap there."""
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + theirs[:at]])).logits[0, -1]
    top = logits.topk(2).values
    return f"first differs at new token {at}: top-2 gap {float(top[0] - top[1]):.3g}"


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_asym", "w4a16_g64", "w4a16_channel", "w8a16"])
def test_greedy_text_equals_the_dequantized_reference(bf16: Path, tmp_path: Path,
                                                      scheme: str) -> None:
    directory = quantize_export(bf16, tmp_path / scheme, scheme)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(
        [str(directory), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
         "--kv-cache-memory", str(64 << 20)]))
    engine = LLMEngine.from_config(config)
    texts = [*DEFAULT_MODEL_PROMPTS,
             engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)]
    prompts = [engine.tokenizer.encode(text) for text in texts]
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True))
    reference = reference_model(directory)
    failures = []
    for text, prompt, output in zip(texts, prompts, outputs, strict=True):
        ours = list(output.token_ids)
        theirs = reference_greedy(reference, prompt, MAX_TOKENS)
        if ours != theirs:
            failures.append(f"{text!r}: {_divergence(reference, prompt, ours, theirs)}")
    assert not failures, f"{scheme}: " + "; ".join(failures)
