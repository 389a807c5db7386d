"""What the capacity check needs from a model's files: its shape (config.json), whether it is
pre-quantized (config.json's quantization_config) and its weight bytes.

Pure functions over bytes and file listings, so they are tested without a store. The shape is
the attention geometry that sizes the KV cache; the weight bytes are the sizes of the files the
engine loads (quantized files are already small, so no dtype arithmetic is needed for them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from kvasir_operator.spec import Architecture, CheckpointQuantization

# In the order an engine prefers them: a prefix holding both safetensors and .bin copies (common
# on the Hugging Face hub) loads only the safetensors, so only those count.
WEIGHT_SUFFIXES = ((".safetensors",), (".gguf",), (".bin", ".pt", ".pth"))


def _first_int(cfg: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def parse_quantization(cfg: Mapping[str, Any]) -> CheckpointQuantization | None:
    """config.json's quantization_config, as far as sizing needs it: the method and what a
    weight is on disk (compressed-tensors: its first config group's weights; GPTQ / AWQ: bits).
    None when there is none or it is not an object; the engine judges the rest at start."""
    raw = cfg.get("quantization_config")
    if not isinstance(raw, dict):
        return None
    method = str(raw.get("quant_method") or "unknown")
    groups = raw.get("config_groups")
    if method == "compressed-tensors" and isinstance(groups, dict) and groups:
        weights = next(iter(groups.values()))
        weights = weights.get("weights") if isinstance(weights, dict) else None
        if isinstance(weights, dict):
            bits = weights.get("num_bits")
            return CheckpointQuantization(method, str(weights.get("type") or "int"),
                                          bits if isinstance(bits, int) else 8)
    bits = raw.get("bits", raw.get("w_bit"))
    return CheckpointQuantization(method, "float" if method == "fp8" else "int",
                                  bits if isinstance(bits, int) else 4)


def parse_config(raw: bytes) -> Architecture:
    """config.json -> layers, KV heads, head dim; ValueError names the missing field."""
    try:
        cfg = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"config.json is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError("config.json must be a JSON object")
    quantization = parse_quantization(cfg)
    # Vision-language models keep the language model's shape in text_config.
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    layers = _first_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first_int(cfg, "num_attention_heads", "n_head")
    if layers is None:
        raise ValueError("config.json: no num_hidden_layers")
    if heads is None:
        raise ValueError("config.json: no num_attention_heads")
    rank = _first_int(cfg, "kv_lora_rank")
    if rank is not None:
        # MLA (DeepSeek): one latent of kv_lora_rank + qk_rope_head_dim per token and layer,
        # stored once, i.e. 2 x 1 head x (rank + rope) / 2 in the K-and-V formula.
        latent = rank + (_first_int(cfg, "qk_rope_head_dim") or 0)
        return Architecture(num_layers=layers, num_kv_heads=1, head_dim=-(-latent // 2),
                            num_heads=heads, quantization=quantization)
    kv_heads = _first_int(cfg, "num_key_value_heads", "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") is True else heads
    head_dim = _first_int(cfg, "head_dim")
    if head_dim is None:
        hidden = _first_int(cfg, "hidden_size", "n_embd", "d_model")
        if hidden is None:
            raise ValueError("config.json: no head_dim and no hidden_size")
        head_dim = hidden // heads
    return Architecture(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                        num_heads=heads, quantization=quantization)


def weight_bytes(files: Iterable[tuple[str, int]]) -> tuple[int, int]:
    """(bytes, file count) of the weight files among (path, size) pairs; all files if none."""
    listed = list(files)
    for suffixes in WEIGHT_SUFFIXES:
        chosen = [size for path, size in listed if path.lower().endswith(suffixes)]
        if chosen:
            return sum(chosen), len(chosen)
    return sum(size for _path, size in listed), len(listed)
