"""The decoder layers of a decode step in one native call (CPU, `--quantization int8/int4`).

Eager PyTorch spends about as long calling a small model's operators as running them: a
single-stream decode step of SmolLM2 (30 layers) is ~450 operator calls plus the Python of the
modules around them, ~9 ms of a 20 ms step on 2 AVX2 cores. When every request of a step
decodes one token, `FusedDecode` hands the embeddings, the layers' weights and the KV caches
to `kernels/cpu.py:decode_layers`, which chains the same native operators the eager layers call
(norms, quantized products, rotary, KV store, decode attention, SwiGLU gate), in the same order
and with the same rounding, so its output equals the eager path's; prefill and mixed steps keep
the eager layers.

The model runner builds it once after loading (`FusedDecode.build`); it is None where the
native path does not cover the model: not on CPU, no native kernels, unquantized or mixed
layers, tensor parallelism, a dtype the kernels lack.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvasir_engine.attention.metadata import AttentionMetadata
from kvasir_engine.kernels import cpu
from kvasir_engine.layers.linear import LinearBase
from kvasir_engine.layers.quantization import Int4Weight, Int8Weight, QuantizedWeight


def _linear_tensors(layer: LinearBase) -> tuple[str, list[torch.Tensor]] | None:
    """(method, tensors in the kernel's order) of a natively quantized layer, else None."""
    q: QuantizedWeight | None = layer.quantized
    if isinstance(q, Int8Weight) and q.cols is None:
        return "int8", [q.rows, q.scale]
    if isinstance(q, Int4Weight) and q.dequantized is None:
        return "int4", [q.packed, q.scale, q.minimum]
    return None


@dataclass(frozen=True)
class FusedDecode:
    method: str  # "int8" | "int4": every linear of every layer
    weights: list[torch.Tensor]  # per layer: norms, qkv bias ([0] if none), qkv, o, gate_up, down
    cos: torch.Tensor  # [max_position, D] rotary tables, as layers/rotary.py keeps them
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def build(cls, model: torch.nn.Module) -> FusedDecode | None:
        """From a loaded, quantized LlamaModel; None when the native path does not apply."""
        if not cpu.available():
            return None
        layers = list(model.layers)  # type: ignore[arg-type]
        embedding = model.embed_tokens.weight  # type: ignore[union-attr]
        dtype = embedding.dtype
        if not layers or dtype not in cpu.NATIVE_DTYPES or embedding.device.type != "cpu" \
                or model.embed_tokens.tp_size != 1:  # type: ignore[union-attr]
            return None
        methods, weights = set(), []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            rotary = attn.rotary
            if rotary.kernel is not None or rotary.cos_cached.dtype != dtype \
                    or attn.head_dim % 8 or attn.qkv_proj.tp_size != 1:
                return None
            bias = attn.qkv_proj.bias
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        bias if bias is not None else torch.empty(0, dtype=dtype)]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                found = _linear_tensors(linear)
                if found is None:
                    return None
                methods.add(found[0])
                weights += found[1]
        if len(methods) != 1:
            return None
        first = layers[0].self_attn
        return cls(methods.pop(), [*weights, model.norm.weight],  # type: ignore[union-attr]
                   first.rotary.cos_cached, first.rotary.sin_cached, first.num_heads,
                   first.num_kv_heads, first.head_dim,
                   layers[0].input_layernorm.eps)

    def can_run(self, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> bool:
        return meta.is_decode_only and meta.block_tables.device.type == "cpu" \
            and kv_caches[0][0].dtype in cpu.NATIVE_DTYPES

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
