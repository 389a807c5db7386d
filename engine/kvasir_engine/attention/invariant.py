"""Attention under --batch-invariant (docs/batch_invariance.md): every query token of a step,
a prompt's or a decode's, attends as a row of its own, over the positions it sees, with one
algorithm whatever the batch, the step budget or the prefix cache.

Without the flag a prompt chunk and a decode row take different paths (the prefill kernel or
matmuls over the chunk, the decode kernel or buckets of rows), and so a prompt's last token
computed alone over cached blocks differs from the same token computed in a cold prefill in
its last bits, as does a chunk boundary. Here each token is a decode row of its request: its
block table and its own context length (its position + 1).

- `native`: the native decode kernel (kernels/cpu.py `decode_attention`), whose work items are
  fixed chunks of ~64 positions merged in their order, a row's alone: the very call the fused
  decode step makes, so decode-only steps may stay fused.
- otherwise its torch twin below: the positions visited in tiles of `TILE` in position order,
  float32 scores and an online softmax, every sum over a fixed length (head_dim or a tile);
  positions past a row's context weigh exactly 0, so padding a row to the batch's longest
  context adds exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvasir_engine.attention.metadata import AttentionMetadata
from kvasir_engine.kernels import cpu

TILE = 64  # positions a tile of the torch twin, fixed whatever the batch


@dataclass(frozen=True)
class InvariantRows:
    """One row per query token of a step."""

    block_tables: torch.Tensor  # [T, B] int32: the block table of the token's request
    seq_lens: torch.Tensor  # [T] int32: the positions the token sees, its own included
    max_len: int


def invariant_rows(meta: AttentionMetadata) -> InvariantRows:
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    request_of_token: list[int] = []
    row_lens: list[int] = []
    for i in range(meta.num_reqs):
        count = qsl[i + 1] - qsl[i]
        request_of_token += [i] * count
        row_lens += range(lens[i] - count + 1, lens[i] + 1)
    device = meta.block_tables.device
    tables = meta.block_tables.index_select(
        0, torch.tensor(request_of_token, dtype=torch.int64, device=device))
    return InvariantRows(tables.to(torch.int32).contiguous(),
                         torch.tensor(row_lens, dtype=torch.int32, device=device),
                         max(row_lens, default=0))


def invariant_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        rows: InvariantRows, scale: float, native: bool) -> torch.Tensor:
    """query [T, H, D], caches [blocks, block_size, Hkv, D] already holding this step's K/V
    -> [T, H, D]."""
    if native:
        return cpu.decode_attention(query.contiguous(), k_cache, v_cache, rows.block_tables,
                                    rows.seq_lens, rows.max_len, scale)
    return tiled_attention(query, k_cache, v_cache, rows, scale)


def tiled_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    rows: InvariantRows, scale: float) -> torch.Tensor:
    """The torch twin: TILE positions at a time, in order, with an online softmax."""
    num_rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = query.device
    q = query.float().view(num_rows, num_kv_heads, group, 1, head_dim)
    top = torch.full((num_rows, num_kv_heads, group), float("-inf"), device=device)
    total = torch.zeros(num_rows, num_kv_heads, group, device=device)
    acc = torch.zeros(num_rows, num_kv_heads, group, head_dim, device=device)
    tables = rows.block_tables.long()
    lens = rows.seq_lens.long().unsqueeze(1)  # [T, 1]
    k_rows = k_cache.view(-1, num_kv_heads, head_dim)
    v_rows = v_cache.view(-1, num_kv_heads, head_dim)
    for start in range(0, rows.max_len, TILE):
        positions = torch.arange(start, start + TILE, device=device)
        blocks = (positions // block_size).clamp_(max=tables.shape[1] - 1)
        slots = (tables[:, blocks] * block_size + positions % block_size).view(-1)
        hidden = (positions >= lens).view(num_rows, 1, 1, TILE)  # past the row's context
        # [T, Hkv, 1, TILE, D], zero where hidden (a slot there may hold anything)
        k = k_rows.index_select(0, slots).view(num_rows, TILE, num_kv_heads, head_dim)
        v = v_rows.index_select(0, slots).view(num_rows, TILE, num_kv_heads, head_dim)
        k = k.float().permute(0, 2, 1, 3).unsqueeze(2)
        v = v.float().permute(0, 2, 1, 3).unsqueeze(2).masked_fill(hidden.unsqueeze(-1), 0.0)
        scores = (q * k).sum(-1).mul_(scale).masked_fill_(hidden, float("-inf"))
        new_top = torch.maximum(top, scores.amax(-1))  # [T, Hkv, G], finite from tile 0
        weights = torch.exp(scores - new_top.unsqueeze(-1))  # [T, Hkv, G, TILE]
        rescale = torch.exp(top - new_top)
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale.unsqueeze(-1) + (weights.unsqueeze(-1) * v).sum(-2)
        top = new_top
    out = acc / total.unsqueeze(-1)
    return out.view(num_rows, num_heads, head_dim).to(query.dtype)
