"""Load checkpoint weights into a model through each parameter's `weight_loader` (docs/architecture.md, rule 9).

Two sources, one stream of (Hugging Face name, tensor) pairs:
- a Hugging Face directory: one or many `*.safetensors` files (the index file lists the shards);
- a `.gguf` file: tensors dequantized to float32 with `gguf.quants.dequantize`, names mapped to
  Hugging Face's, and llama.cpp's Q/K row permutation undone (it interleaves the two rotary
  halves for its own RoPE; our rotate-half RoPE needs Hugging Face's order).
No pickle anywhere: `torch.load` is never called. Broken files fail with a line naming the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvasir_engine.checkpoint.arch import ModelArch
from kvasir_engine.checkpoint.format import CheckpointFormat, checkpoint_format
from kvasir_engine.checkpoint.metadata import open_gguf, read_checkpoint_quantization
from kvasir_engine.checkpoint.quantized_tensors import convert_quantized

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_weights(model: nn.Module, source: str | Path, arch: ModelArch,
                 keep: Callable[[str], bool] | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint; error on missing or extra tensors.

    `keep(name)` false skips a tensor before it is read (a pipeline stage loads only its own
    part: models/pipeline_stage.py:PipelineStage.owns_weight)."""
    path = Path(source)
    keep = keep or _keep_all
    if checkpoint_format(path) is CheckpointFormat.GGUF_FILE:
        weights = iter_gguf(path, arch, keep)
    else:
        weights = iter_safetensors(path, keep)
        quant = read_checkpoint_quantization(path)
        if quant is not None:  # a pre-quantized checkpoint: its modules in our staged form
            weights = convert_quantized(weights, quant)
    load_named_weights(model, weights, arch)


def _keep_all(name: str) -> bool:
    return True


def load_named_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]],
                       arch: ModelArch) -> None:
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue  # the head shares the embedding's parameter
        if (name == "model.embed_tokens.weight" and arch.tie_word_embeddings
                and "lm_head.weight" in params):
            # A pipeline's last stage holds the tied head without the embedding: its own copy.
            loader = getattr(params["lm_head.weight"], "weight_loader", default_weight_loader)
            loader(params["lm_head.weight"], tensor, None)
            loaded.add("lm_head.weight")
            if name not in params:
                continue
        target, shard_id = name, None
        for checkpoint_part, (fused_part, shard) in packed.items():
            if f".{checkpoint_part}." in name:
                target, shard_id = name.replace(checkpoint_part, fused_part), shard
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {arch.architecture}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor, shard_id)
        loaded.add(target)
    tied = {"lm_head.weight"} if arch.tie_word_embeddings and "lm_head.weight" not in loaded \
        and "model.embed_tokens.weight" in loaded else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor,
                          shard_id: str | int | None = None) -> None:
    """Replicated parameters (norm weights): copy the whole tensor."""
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: checkpoint {tuple(loaded.shape)}, "
                         f"model {tuple(param.shape)}")
    param.data.copy_(loaded)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files (pickled .bin is not supported)")
    for file in files:
        if not file.is_file():
            raise ValueError(f"{file}: listed in the index but missing")
    return files


def iter_safetensors(model_dir: Path, keep: Callable[[str], bool] = _keep_all,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if keep(name):
                        yield name, handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own untyped errors
            if isinstance(exc, ValueError) and str(exc).startswith("checkpoint"):
                raise
            raise ValueError(f"{file}: corrupt or truncated safetensors file "
                             f"({type(exc).__name__}: {exc})") from exc


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_BLOCK.fullmatch(name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's convert-time permutation of Q/K rows (per head: interleaved pairs
    back to two contiguous halves)."""
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def iter_gguf(path: Path, arch: ModelArch, keep: Callable[[str], bool] = _keep_all,
              ) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = open_gguf(path)
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: unexpected GGUF tensor {tensor.name!r}")
        if not keep(name):
            continue
        try:
            data = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:  # noqa: BLE001 - truncated data or an unsupported type
            raise ValueError(f"{path}: cannot dequantize {tensor.name} "
                             f"({tensor.tensor_type.name}): {exc}") from exc
        # GGUF lists dims fastest-first; numpy's view is already [rows, cols] = [out, in].
        shape = tuple(int(d) for d in reversed(tensor.shape))
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        data = np.array(data, dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            data = unpermute_rope_rows(data, arch.num_attention_heads)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            data = unpermute_rope_rows(data, arch.num_key_value_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(data))
