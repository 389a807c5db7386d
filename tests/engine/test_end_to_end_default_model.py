"""The default model (SmolLM2-135M GGUF, float32) through the whole engine vs transformers.

transformers loads the same GGUF (it dequantizes to float32). Four prompts sharing a 48-token
prefix run with 32-token prefill chunks and a KV cache too small for all of them at once, so the
run exercises chunked prefill, preemption with recompute, and prefix-cache hits on the way back.
"""

from __future__ import annotations

import random

import torch
from helpers import default_gguf_path
from kvasir_engine.core.request import SamplingParams
from test_end_to_end import engine_for, step_to_end

MAX_TOKENS = 12
# One token's K+V in float32: 2 x 30 layers x 3 KV heads x 64 dims x 4 bytes.
BLOCK_BYTES = 2 * 30 * 3 * 64 * 4 * 16


def reference_greedy(prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outputs.append(ids[len(prompt):])
    return outputs


def test_default_model_chunked_preempted_and_prefix_cached_matches_transformers() -> None:
    rng = random.Random(5)
    shared = [rng.randrange(1000, 40000) for _ in range(48)]
    prompts = [shared + [rng.randrange(1000, 40000) for _ in range(rng.randint(5, 20))]
               for _ in range(4)]
    expected = reference_greedy(prompts)
    # 10 usable blocks (160 tokens) hold one 128-token sequence but not four of ~80 tokens.
    engine = engine_for(default_gguf_path(), "--max-model-len", "128",
                        "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
                        "--kv-cache-memory", str(11 * BLOCK_BYTES))
    run = step_to_end(engine, prompts,
                      SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert run.tokens == expected
    assert run.num_preemptions > 0, "the small cache was meant to force preemption"
    assert run.num_prefix_hit_tokens > 0, "later prompts were meant to reuse the shared prefix"
    engine.shutdown()
