"""The decoder layers of a decode step in one native call (CPU: `--quantization int8/int4`, a
pre-quantized int4 / int8 checkpoint (weight-only ones through the float-activation products
"int4wo" / "int8wo"), or unquantized bfloat16 with oneDNN-packed weights).

Eager PyTorch spends about as long calling a small model's operators as running them: a
single-stream decode step of SmolLM2 (30 layers) is ~450 operator calls plus the Python of the
modules around them, ~9 ms of a 20 ms step on 2 AVX2 cores. When every request of a step
decodes one token, `FusedDecode` hands the embeddings, the layers' weights and the KV caches
to `kernels/cpu.py:decode_layers`, which chains the same native operators the eager layers call
(norms, quantized products, rotary, KV store, decode attention, SwiGLU gate), in the same order
and with the same rounding, so its output equals the eager path's; prefill and mixed steps keep
the eager layers.

Whether it runs is the process's `KernelChoice.fused_decode` (kernels/choice.py: CPU, native
kernels, a quantized model or oneDNN-packed bfloat16 weights, one process, float32/bfloat16);
the model runner then builds it once after loading (`FusedDecode.build`). The weights are
taken from the model's modules by name (`FusedLayerWeights`); `kernel_weights` is the one
place that lays them out in the positional order cpu_decode.cpp reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from kvasir_engine.attention.metadata import AttentionMetadata
from kvasir_engine.kernels import cpu
from kvasir_engine.layers.dense import Bf16PairWeight
from kvasir_engine.layers.onednn import OneDnnWeight
from kvasir_engine.layers.quantization import (
    Int4Weight,
    Int4WeightOnly,
    Int8Weight,
    Int8WeightOnly,
    WeightForm,
)


@dataclass(frozen=True)
class FusedLayerWeights:
    """One decoder layer's weights, named; the fields are in the order cpu_decode.cpp reads."""

    input_layernorm: torch.Tensor  # [H]
    post_attention_layernorm: torch.Tensor  # [H]
    qkv_bias: torch.Tensor  # [(Hq + 2 Hkv) * D], or [0] when the model has none
    qkv_proj: WeightForm
    o_proj: WeightForm
    gate_up_proj: WeightForm
    down_proj: WeightForm

    @classmethod
    def from_layer(cls, layer: nn.Module, index: int) -> FusedLayerWeights:
        """From a LlamaDecoderLayer, each weight looked up by its module's name."""
        bias = _module(layer, "self_attn.qkv_proj", index).bias
        input_layernorm = _weight(layer, "input_layernorm", index)
        return cls(
            input_layernorm=input_layernorm,
            post_attention_layernorm=_weight(layer, "post_attention_layernorm", index),
            qkv_bias=bias if isinstance(bias, torch.Tensor)
            else torch.empty(0, dtype=input_layernorm.dtype),
            qkv_proj=_weight_form(layer, "self_attn.qkv_proj", index),
            o_proj=_weight_form(layer, "self_attn.o_proj", index),
            gate_up_proj=_weight_form(layer, "mlp.gate_up_proj", index),
            down_proj=_weight_form(layer, "mlp.down_proj", index))


def _module(layer: nn.Module, name: str, index: int) -> nn.Module:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        raise ValueError(f"fused decode: decoder layer {index} has no module {name!r}") from None


def _weight(layer: nn.Module, name: str, index: int) -> torch.Tensor:
    weight = getattr(_module(layer, name, index), "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"fused decode: layer {index}'s {name} has no weight tensor")
    return weight


def _weight_form(layer: nn.Module, name: str, index: int) -> WeightForm:
    q = getattr(_module(layer, name, index), "quantized", None)
    if not isinstance(q, Int8Weight | Int4Weight | Int8WeightOnly | Int4WeightOnly | OneDnnWeight
                      | Bf16PairWeight):
        raise ValueError(f"fused decode: layer {index}'s {name} is neither quantized nor packed")
    return q


def _linear_tensors(q: WeightForm, where: str) -> tuple[str, list[torch.Tensor]]:
    """(method, tensors in the kernel's order) of a natively quantized or packed linear."""
    if isinstance(q, OneDnnWeight):
        return "onednn", [q.packed]
    if isinstance(q, Bf16PairWeight):
        return "bf16", [q.packed]
    if isinstance(q, Int8Weight) and q.cols is None:
        return "int8", [q.rows, q.scale]
    if isinstance(q, Int4Weight) and q.dequantized is None:
        return "int4", [q.packed, q.scale, q.minimum]
    if isinstance(q, Int8WeightOnly) and q.dequantized is None:
        return "int8wo", [q.rows, q.scale]
    if isinstance(q, Int4WeightOnly) and q.dequantized is None:
        return "int4wo", [q.packed, q.scale, q.minimum]
    raise ValueError(f"fused decode: {where} is quantized for the torch fallback, not the "
                     "native kernels")


def kernel_weights(layers: Sequence[FusedLayerWeights],
                   final_norm: torch.Tensor) -> tuple[str, list[torch.Tensor]]:
    """(method, the positional weight list of kernels/cpu.py:decode_layers): per layer its
    fields in declaration order, a linear as its tensors (int8, int8wo: rows, scale; int4,
    int4wo: packed, scale, minimum; onednn, bf16: the packed weight), then the final norm [H].
    Every linear must share one method."""
    methods: set[str] = set()
    weights: list[torch.Tensor] = []
    for index, layer in enumerate(layers):
        for f in fields(layer):
            value = getattr(layer, f.name)
            if isinstance(value, torch.Tensor):
                weights.append(value)
                continue
            method, tensors = _linear_tensors(value, f"layer {index}'s {f.name}")
            methods.add(method)
            weights += tensors
    if len(methods) != 1:
        raise ValueError(f"fused decode: one weight form for every linear, got {sorted(methods)}")
    method = methods.pop()
    per_linear = {"int4": 3, "int4wo": 3, "int8": 2, "int8wo": 2, "onednn": 1, "bf16": 1}
    per_layer = 3 + 4 * per_linear[method]  # as cpu_decode.cpp counts
    if len(weights) != len(layers) * per_layer:
        raise ValueError(f"fused decode: {len(weights)} weights for {len(layers)} layers of "
                         f"{method}")
    return method, [*weights, final_norm]


@dataclass(frozen=True)
class FusedDecode:
    layers: tuple[FusedLayerWeights, ...]
    final_norm: torch.Tensor  # [H]
    cos: torch.Tensor  # [max_position, D] rotary tables, as layers/rotary.py keeps them
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    # "int8" | "int4" | "int8wo" | "int4wo" | "onednn" | "bf16": every linear
    method: str = field(init=False)
    weights: list[torch.Tensor] = field(init=False)  # kernel_weights(layers, final_norm)

    def __post_init__(self) -> None:
        method, weights = kernel_weights(self.layers, self.final_norm)
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "weights", weights)

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecode:
        """From a loaded, quantized and cast LlamaModel; a ValueError names what does not fit."""
        layers = list(model.layers)  # type: ignore[arg-type]
        embedding = model.embed_tokens.weight  # type: ignore[union-attr]
        if not layers or embedding.dtype not in cpu.NATIVE_DTYPES \
                or embedding.device.type != "cpu":
            raise ValueError(f"fused decode: needs decoder layers on the CPU in one of "
                             f"{cpu.NATIVE_DTYPES}, got {embedding.dtype} on {embedding.device}")
        final_norm = getattr(model.get_submodule("norm"), "weight", None)
        if not isinstance(final_norm, torch.Tensor):
            raise ValueError("fused decode: the model has no final norm weight")
        first = layers[0].self_attn
        return cls(tuple(FusedLayerWeights.from_layer(layer, i) for i, layer in enumerate(layers)),
                   final_norm,
                   first.rotary.cos_cached, first.rotary.sin_cached, first.num_heads,
                   first.num_kv_heads, first.head_dim, layers[0].input_layernorm.eps)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Decode-only steps; the rest (dtypes, device) the kernel choice settled."""
        return meta.is_decode_only

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata) -> torch.Tensor:
        """hidden [M, H] embeddings of the M decode tokens -> the final norm's output [M, H]."""
        return cpu.decode_layers(
            hidden, positions, self.weights, self.method, [k for k, _ in kv_caches],
            [v for _, v in kv_caches], meta.block_tables.to(torch.int32),
            meta.seq_lens.to(torch.int32), meta.slot_mapping, meta.max_seq_len, self.cos,
            self.sin, self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
            self.head_dim ** -0.5)
