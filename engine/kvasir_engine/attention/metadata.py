"""`AttentionMetadata`: what every attention backend needs to know about one ragged batch.

The model runner builds it once per forward pass (docs/architecture.md, rule 7) and passes it down explicitly.
Shapes use: R = requests in the batch, T = tokens in the batch (sum of query lengths),
B = max blocks per request in this batch.

The KV cache of one layer is two tensors `k_cache, v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
`block_id * block_size + offset_in_block`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    # [T] int64: flat cache slot where each new token's K/V is written.
    slot_mapping: torch.Tensor
    # [R + 1] int32: cumulative query lengths; request i owns tokens [qsl[i], qsl[i+1]).
    query_start_loc: torch.Tensor
    # [R] int32: context length of each request after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [R, B] int32: block ids of each request, padded with 0 beyond its blocks.
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Plain-int copies of query_start_loc / seq_lens, so CPU paths need no device sync.
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    # True when every request decodes exactly one token (the CUDA-graph / decode-kernel case).
    is_decode_only: bool

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def slot_mapping(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of a request with this block table."""
    return [block_ids[pos // block_size] * block_size + pos % block_size
            for pos in range(start, end)]


def build_attention_metadata(slots: list[int], query_start_loc: list[int], seq_lens: list[int],
                             block_tables: list[list[int]],
                             device: torch.device) -> AttentionMetadata:
    """The metadata of a ragged batch from plain lists (block tables padded here with 0)."""
    max_blocks = max(len(table) for table in block_tables)
    tables = [table + [0] * (max_blocks - len(table)) for table in block_tables]
    query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)]

    def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return AttentionMetadata(
        slot_mapping=as_tensor(slots, torch.int64),
        query_start_loc=as_tensor(query_start_loc, torch.int32),
        seq_lens=as_tensor(seq_lens, torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32).to(device, non_blocking=True),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(query_start_loc),
        seq_lens_cpu=tuple(seq_lens),
        is_decode_only=all(n == 1 for n in query_lens),
    )
