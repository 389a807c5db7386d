"""The default model (SmolLM2-135M, float32): greedy output token-identical with n-gram
speculation and with the model as its own draft, on text that repeats itself."""

from __future__ import annotations

import json

import pytest
from helpers import default_gguf_path
from kvasir_engine.core.request import SamplingParams
from test_end_to_end import engine_for
from test_speculative import run

TEXT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n\ndef")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2, "disable_by_batch_size": 64},
    {"model": "DEFAULT", "num_speculative_tokens": 3, "disable_by_batch_size": 64},
], ids=["ngram", "self-draft"])
def test_default_model_greedy_is_token_identical(config: dict[str, object]) -> None:
    path = default_gguf_path()
    if config.get("model") == "DEFAULT":
        config = {**config, "model": str(path)}
    plain_engine = engine_for(path, "--max-model-len", "256")
    prompts = [plain_engine.tokenizer.encode(TEXT), plain_engine.tokenizer.encode("Once upon")]
    plain, _ = run(plain_engine, prompts, GREEDY)
    spec_engine = engine_for(path, "--max-model-len", "256", "--speculative-config",
                             json.dumps(config))
    speculative, totals = run(spec_engine, prompts, GREEDY)
    assert speculative == plain
    assert totals["accepted"] > 0
