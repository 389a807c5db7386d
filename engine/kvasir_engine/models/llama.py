"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 and SmolLM2 are all this one module.

Pre-norm blocks of GQA self-attention with RoPE and a SwiGLU MLP, RMSNorm, tied or untied LM
head; Qwen2 differs only by q/k/v biases. Checkpoint names follow Hugging Face; the fused
`qkv_proj` and `gate_up_proj` are filled shard by shard through `packed_modules_mapping`.
Which kernel each layer runs is the `KernelChoice` the model is built with, handed to every
layer at construction.

Under pipeline parallelism the model is built for one `PipelineStage` (models/pipeline_stage.py):
only that stage's layers (the others are parameter-free placeholders, so checkpoint names keep
their indices), the embedding on the first stage, the norm and LM head on the last.
`forward_stage` runs the stage's part and returns the hidden states and residual to hand on;
moving them between stages is the worker's business (worker/pipeline.py), never the model's.
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
from kvasir_engine.models.pipeline_stage import PipelineStage, whole_model

KVCache = tuple[torch.Tensor, torch.Tensor]


class MissingLayer(nn.Module):
    """The place of a decoder layer another pipeline stage owns: no parameters, never run."""


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
                 group: TensorParallelGroup | None, stage: PipelineStage):
        super().__init__()
        self.stage = stage
        self.embed_tokens = (VocabParallelEmbedding(arch.vocab_size, arch.hidden_size,
                                                    tp_rank, tp_size, group)
                             if stage.is_first else None)
        # One backend instance for every layer (the torch one keeps a per-step plan), and one
        # rotary table shared by every layer.
        backend = make_backend(kernels)
        rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                 arch.rope_scaling, impl=kernels.rotary)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, kernels, backend, rotary, tp_rank, tp_size, group)
            if stage.owns_layer(i) else MissingLayer()
            for i in range(arch.num_hidden_layers))
        self.norm = (RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels.norm)
                     if stage.is_last else None)
        # Decode-only steps in one native call (`kernels.fused_decode`): set up by
        # enable_fused_decode once the weights are loaded and quantized.
        self.fused_decode: FusedDecode | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """The whole model (one stage owning everything): ids [T] -> normed hidden [T, H]."""
        forward = self.start_forward(input_ids, positions, kv_caches, meta)
        while forward.run_next_layer():
            pass
        return forward.result()

    def start_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[KVCache], meta: AttentionMetadata) -> LayerwiseForward:
        """The whole model's pass, for its caller to run a decoder layer at a time."""
        if self.embed_tokens is None or self.norm is None:
            raise ValueError("forward runs the whole model; a pipeline stage runs forward_stage")
        return LayerwiseForward(self, self.embed_tokens(input_ids), positions, kv_caches, meta)

    def forward_layers(self, positions: torch.Tensor, hidden: torch.Tensor,
                       residual: torch.Tensor | None, kv_caches: list[KVCache],
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers; `kv_caches` holds one (K, V) per owned layer."""
        owned = self.layers[self.stage.start_layer:self.stage.end_layer]
        for layer, kv_cache in zip(owned, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return hidden, residual


class LayerwiseForward:
    """One pass of the whole model that its caller runs a decoder layer at a time.

    Between two `run_next_layer` calls the caller may run other whole passes of the same model
    (the engine thread interjects a first token there, core/scheduler.py "Interjection"):
    every tensor this pass still needs (hidden, residual, its metadata) is its own. A decode
    step that the fused native call takes (`FusedDecode`) has no such point: it runs whole
    when the pass starts.
    """

    def __init__(self, model: LlamaModel, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata) -> None:
        self._model, self._positions, self._kv_caches, self._meta = (model, positions,
                                                                     kv_caches, meta)
        self._layers = model.layers[model.stage.start_layer:model.stage.end_layer]
        self._num_done = 0
        self._hidden, self._residual = hidden, None  # [T, H] each
        self._result: torch.Tensor | None = None
        if model.fused_decode is not None and model.fused_decode.can_run(meta):
            self._result = model.fused_decode(hidden, positions, kv_caches, meta)
        elif not self._layers:
            assert model.norm is not None
            self._result = model.norm(hidden, None)[0]

    def run_next_layer(self) -> bool:
        """Runs the next decoder layer (the norm after the last); whether a layer remains."""
        if self._result is not None:
            return False
        layer = self._layers[self._num_done]
        self._hidden, self._residual = layer(self._positions, self._hidden, self._residual,
                                             self._kv_caches[self._num_done], self._meta)
        self._num_done += 1
        if self._num_done < len(self._layers):
            return True
        assert self._model.norm is not None
        self._result = self._model.norm(self._hidden, self._residual)[0]
        return False

    def result(self) -> torch.Tensor:
        """The normed hidden states [T, H], once every layer has run."""
        if self._result is None:
            raise RuntimeError("the forward pass has layers left to run")
        return self._result


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
                 tp_size: int = 1, group: TensorParallelGroup | None = None,
                 stage: PipelineStage | None = None):
        super().__init__()
        self.arch = arch
        self.kernels = kernels
        self.stage = stage or whole_model(arch)
        self.model = LlamaModel(arch, kernels, tp_rank, tp_size, group, self.stage)
        # A last stage without the embedding loads its own copy of the tied weight.
        self.lm_head = (ParallelLMHead(arch.vocab_size, arch.hidden_size, tp_rank, tp_size,
                                       group) if self.stage.is_last else None)
        if (arch.tie_word_embeddings and self.lm_head is not None
                and self.model.embed_tokens is not None):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (`LlamaModel.forward`)."""
        hidden: torch.Tensor = self.model(input_ids, positions, kv_caches, meta)
        return hidden

    def start_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[KVCache], meta: AttentionMetadata) -> LayerwiseForward:
        """`LlamaModel.start_forward`: the pass a layer at a time."""
        return self.model.start_forward(input_ids, positions, kv_caches, meta)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[KVCache], meta: AttentionMetadata,
                      hidden: torch.Tensor | None, residual: torch.Tensor | None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's part. The first stage embeds `input_ids` [T] (`hidden` None); the
        others continue from the previous stage's `hidden`, `residual` [T, H]. Returns the
        un-normed hidden and residual to hand on, or on the last stage the normed hidden [T, H]
        (residual None)."""
        model = self.model
        if hidden is None:
            if model.embed_tokens is None:
                raise ValueError(f"stage {self.stage.pp_rank} needs the previous stage's hidden")
            hidden = model.embed_tokens(input_ids)
        hidden, residual = model.forward_layers(positions, hidden, residual, kv_caches, meta)
        if model.norm is None:
            return hidden, residual
        return model.norm(hidden, residual)[0], None

    def enable_fused_decode(self) -> None:
        """After loading, quantizing and casting, where `kernels.fused_decode` chose it: run
        decode-only steps through one native call (models/fused_decode.py)."""
        if not self.kernels.fused_decode:
            raise ValueError("fused decode was not chosen for this model's kernels")
        self.model.fused_decode = FusedDecode.build(self.model)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] (one row per sampling request) -> logits [R, vocab]."""
        if self.lm_head is None:
            raise ValueError(f"stage {self.stage.pp_rank} has no LM head (the last stage does)")
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
