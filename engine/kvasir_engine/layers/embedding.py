"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab.

The embedding looks up only ids in its slice (zeros elsewhere) and the partial rows are summed
across ranks; the LM head computes its slice of the logits and gathers them along the vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvasir_engine.layers.dense import DenseForm, pack_dense
from kvasir_engine.layers.parallel import TensorParallelGroup
from kvasir_engine.layers.quantization import Int8Weight, linear, quantize_int8


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1,
                 group: TensorParallelGroup | None = None):
        super().__init__()
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.vocab_size = vocab_size
        # The last shard may be shorter; pad every shard to the same size.
        self.num_per_rank = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.num_per_rank
        self.vocab_end = min(vocab_size, self.vocab_start + self.num_per_rank)
        self.weight = nn.Parameter(torch.zeros(self.num_per_rank, hidden_size),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding shape mismatch: checkpoint {tuple(loaded.shape)}, "
                             f"model ({self.vocab_size}, {param.shape[1]})")
        part = loaded[self.vocab_start:self.vocab_end]
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, 0)
        y = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        if self.group is None:
            raise ValueError("VocabParallelEmbedding with tp_size > 1 needs a group")
        return self.group.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    quantized: Int8Weight | DenseForm | None = None

    def quantize(self, method: str, dtype: torch.dtype | None = None,
                 native: bool = False, weight_only_prefill: bool = False) -> None:
        """An int8 copy for the logits whatever the method (GGUF files keep the LM head at
        8 bits too; it takes a sequence's last row only, so no prompt rows); the weight stays,
        since it may be the tied embedding."""
        self.quantized = quantize_int8(self.weight.data, dtype, native)

    def pack(self, method: str) -> None:
        """A packed copy for the logits (unquantized bfloat16 on CPU, layers/dense.py); the
        weight stays, since it may be the tied embedding."""
        if self.quantized is None:
            self.quantized = pack_dense(self.weight.data, method)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab]
        logits = linear(hidden, self.weight, self.quantized)
        if self.tp_size > 1:
            if self.group is None:
                raise ValueError("ParallelLMHead with tp_size > 1 needs a group")
            logits = self.group.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
