"""The attention backend interface: the seam where GPU kernels plug into the model.

A backend stores this step's K/V in the paged cache, then attends every query token to its
request's whole context: causal within the new tokens, full over the cached prefix.
The pure-PyTorch backend (`torch_backend.py`) is the CPU path and the numerical reference;
the Triton backend (`triton_backend.py`) is chosen on CUDA. `--attention-backend` forces either.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvasir_engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
