"""The attention backend on CUDA: Triton kernels for the K/V store and paged attention.

A decode-only batch (every request one new token; the CUDA-graph case) goes to the split-K
decode kernel, whose grid depends on `meta.max_seq_len` only through the partition count, so
a graph captured with max_seq_len = max_model_len replays for any shorter batch. Any other batch
(prefill chunks, possibly with decodes riding along) goes to the ragged prefill kernel, which
treats a decode as a chunk of one. On CPU the same kernels run under Triton's interpreter
(`kvasir_engine.kernels` sets TRITON_INTERPRET=1 there), which only tests use.
"""

from __future__ import annotations

import torch

from kvasir_engine.attention.metadata import AttentionMetadata
from kvasir_engine.kernels.kv_store import kv_store
from kvasir_engine.kernels.paged_attention import paged_decode_attention
from kvasir_engine.kernels.prefill_attention import paged_prefill_attention

# Tokens per decode partition: long enough that short contexts need one pass (no merge), short
# enough that a few long requests still fill the GPU's SMs with (request, head, partition) programs.
DECODE_PARTITION_SIZE = 512


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, decode_partition_size: int = DECODE_PARTITION_SIZE,
                 prefill_block_m: int | None = None, prefill_block_n: int | None = None):
        self.decode_partition_size = decode_partition_size
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        query = query.contiguous() if query.stride(-1) != 1 else query
        kv_store(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return paged_decode_attention(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=meta.max_seq_len, partition_size=self.decode_partition_size)
        # 64x64 tiles feed the tensor cores on a GPU; 32x32 keeps the interpreter quick.
        tile = 64 if query.is_cuda else 32
        return paged_prefill_attention(
            query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            max_query_len=meta.max_query_len, block_m=self.prefill_block_m or tile,
            block_n=self.prefill_block_n or tile)
