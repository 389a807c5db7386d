"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 and SmolLM2 are all this one module.

Pre-norm blocks of GQA self-attention with RoPE and a SwiGLU MLP, RMSNorm, tied or untied LM
head; Qwen2 differs only by q/k/v biases. Checkpoint names follow Hugging Face; the fused
`qkv_proj` and `gate_up_proj` are filled shard by shard through `packed_modules_mapping`.
Which kernel each layer runs is the `KernelChoice` the model is built with, handed to every
layer at construction.
"""

from __future__ import annotations

import torch
from torch import nn

from kvasir_engine.attention.backend import AttentionBackend
from kvasir_engine.attention.metadata import AttentionMetadata
from kvasir_engine.attention.selector import make_backend
from kvasir_engine.checkpoint.arch import ModelArch
from kvasir_engine.kernels.choice import KernelChoice
from kvasir_engine.layers.activation import SiluAndMul
from kvasir_engine.layers.attention import Attention
from kvasir_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvasir_engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvasir_engine.layers.norm import RMSNorm
from kvasir_engine.layers.parallel import TensorParallelGroup
from kvasir_engine.layers.rotary import RotaryEmbedding
from kvasir_engine.models.fused_decode import FusedDecode

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, rotary: RotaryEmbedding,
                 tp_rank: int, tp_size: int, group: TensorParallelGroup | None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim,
                                          arch.num_attention_heads, arch.num_key_value_heads,
                                          bias=arch.attention_bias, tp_rank=tp_rank,
                                          tp_size=tp_size, group=group)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.o_proj = RowParallelLinear(arch.num_attention_heads * arch.head_dim,
                                        arch.hidden_size, bias=False, tp_rank=tp_rank,
                                        tp_size=tp_size, group=group)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, kv_cache, meta))
        return out


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, kernels: KernelChoice, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [arch.intermediate_size] * 2, bias=False, tp_rank=tp_rank,
            tp_size=tp_size, group=group)
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, bias=False,
                                           tp_rank=tp_rank, tp_size=tp_size, group=group)
        self.act_fn = SiluAndMul(kernels.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, kernels: KernelChoice, backend: AttentionBackend,
                 rotary: RotaryEmbedding, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None):
        super().__init__()
        self.self_attn = LlamaAttention(arch, backend, rotary, tp_rank, tp_size, group)
        self.mlp = LlamaMLP(arch, kernels, tp_rank, tp_size, group)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels.norm)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps,
                                                kernels.norm)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, kernels: KernelChoice, tp_rank: int, tp_size: int,
                 group: TensorParallelGroup | None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size,
                                                   tp_rank, tp_size, group)
        # One backend instance for every layer (the torch one keeps a per-step plan), and one
        # rotary table shared by every layer.
        backend = make_backend(kernels)
        rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                 arch.rope_scaling, impl=kernels.rotary)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, kernels, backend, rotary, tp_rank, tp_size, group)
            for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels.norm)
        # Decode-only steps in one native call (`kernels.fused_decode`): set up by
        # enable_fused_decode once the weights are loaded and quantized.
        self.fused_decode: FusedDecode | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.fused_decode is not None and self.fused_decode.can_run(meta):
            return self.fused_decode(hidden, positions, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        normed: torch.Tensor = self.norm(hidden, residual)[0]
        return normed


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: ModelArch, kernels: KernelChoice, tp_rank: int = 0,
                 tp_size: int = 1, group: TensorParallelGroup | None = None):
        super().__init__()
        self.arch = arch
        self.kernels = kernels
        self.model = LlamaModel(arch, kernels, tp_rank, tp_size, group)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp_rank, tp_size, group)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        hidden: torch.Tensor = self.model(input_ids, positions, kv_caches, meta)
        return hidden

    def enable_fused_decode(self) -> None:
        """After loading, quantizing and casting, where `kernels.fused_decode` chose it: run
        decode-only steps through one native call (models/fused_decode.py)."""
        if not self.kernels.fused_decode:
            raise ValueError("fused decode was not chosen for this model's kernels")
        self.model.fused_decode = FusedDecode.build(self.model)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] (one row per sampling request) -> logits [R, vocab]."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
