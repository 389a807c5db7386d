"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file.

transformers dequantizes the GGUF to float32 and undoes llama.cpp's Q/K permutation itself, so
it is an independent reference for our loader, tokenizer and forward pass.
"""

from __future__ import annotations

import pytest
import torch
from helpers import StepDriver, default_gguf_path, tiny_engine_config
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.detokenizer import IncrementalDetokenizer
from kvasir_engine.tokenizer import load_tokenizer
from kvasir_engine.worker.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
GGUF = default_gguf_path()
TEXTS = [
    "Hello world!",
    "The capital of France is",
    "Grüße aus Köln. 東京は日本の首都です。 🚀✨",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  leading spaces\tand\ttabs\n\nnew lines",
    "digits 12345 and 3.14, code: def f(x): return x**2",
]


@pytest.fixture(scope="module")
def reference_tokenizer():  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(GGUF)


def test_tokenizer_matches_transformers(tokenizer, reference_tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(ids) == reference_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.eos_token_id == 2 and tokenizer.token_text(2) == "<|im_end|>"


def test_chat_template_matches_transformers(tokenizer, reference_tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3+3?"}]
    for conversation in (messages[1:2], messages):
        ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        theirs = reference_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                         add_generation_prompt=True)
        assert ours == theirs


def test_greedy_tokens_match_transformers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    runner = ModelRunner(tiny_engine_config(GGUF, max_model_len=256, block_size=16,
                                            kv_bytes=64 << 20))
    runner.initialize_kv_cache()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    prompts = {
        "plain": tokenizer.encode("The capital of France is"),
        "story": tokenizer.encode("Once upon a time, in a small village,"),
        "chat": tokenizer.encode(chat, add_special_tokens=False),
    }
    num_tokens = 16
    # min_tokens bans EOS as transformers' min_new_tokens does, so both run all 16 steps.
    params = SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens)
    ours = StepDriver(runner, 16).generate(prompts, dict.fromkeys(prompts, params), num_tokens,
                                           chunk=12)
    for name, prompt in prompts.items():
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                                     min_new_tokens=num_tokens, do_sample=False)
        expected = out[0, len(prompt):].tolist()
        assert ours[name] == expected, (name, tokenizer.decode(ours[name]),
                                        tokenizer.decode(expected))


def test_incremental_detokenizer_never_splits_characters(tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text in ["Emoji 🚀✨ and 東京 and Grüße", "🇳🇴 flags 👩‍👩‍👧 family", "中文字符测试"]:
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
        deltas = [detok.add_tokens([i]) for i in ids]
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)
        # Multi-byte characters really were split across tokens, and held back until whole.
        assert "" in deltas

