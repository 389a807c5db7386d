"""Paged attention in plain PyTorch: the CPU path and the numerical reference for the kernels.

Each step first scatters the new K/V into their cache slots, then every request attends over
its whole context gathered from its block table: causal within its new tokens, full over the
cached prefix. Decode-only requests (one query each) are batched into one padded gather and
one masked SDPA call; requests with several new tokens (prefill chunks) run one SDPA each,
which is cheap next to their matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvasir_engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        decode_rows = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        if len(decode_rows) > 1:
            _decode_batch(query, k_cache, v_cache, meta, scale, decode_rows, out)
            done = set(decode_rows)
        else:
            done = set()
        for i in range(meta.num_reqs):
            if i in done:
                continue
            start, end = qsl[i], qsl[i + 1]
            k, v = _gather(k_cache, v_cache, meta.block_tables[i], seq_lens[i])
            out[start:end] = _attend(query[start:end], k, v, seq_lens[i], scale)
        return out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's K/V into flat slot slot_mapping[t] of the paged cache."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len tokens of one request's K and V: [seq_len, Hkv, D] each."""
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)]
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int,
            scale: float) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of a seq_len context; k, v [seq_len, Hkv, D]."""
    num_queries = q.shape[0]
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device).unsqueeze(1)
    mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # [Q, seq_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def _decode_batch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, rows: list[int],
                  out: torch.Tensor) -> None:
    """One query per request: gather contexts padded to the longest, mask the padding."""
    block_size = k_cache.shape[1]
    seq_lens = [meta.seq_lens_cpu[i] for i in rows]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    index = torch.tensor(rows, device=query.device)
    tables = meta.block_tables[index, :num_blocks]  # [N, nb]
    k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [N, L, Hkv, D]
    v = v_cache[tables].flatten(1, 2)[:, :max_len]
    token_index = torch.tensor([meta.query_start_loc_cpu[i] for i in rows], device=query.device)
    q = query[token_index].unsqueeze(2)  # [N, H, 1, D]
    lens = torch.tensor(seq_lens, device=query.device).unsqueeze(1)
    mask = (torch.arange(max_len, device=query.device).unsqueeze(0) < lens)[:, None, None, :]
    if query.dtype == torch.float32:
        o = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[2])
    else:
        o = _grouped_decode(q, k, v, mask, scale)
    out[token_index] = o.squeeze(2)


def _grouped_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Decode attention as two grouped matmuls: q [N, H, 1, D], k/v [N, L, Hkv, D] -> [N, H, 1, D].

    On CPU, SDPA in bfloat16/float16 with a mask and GQA falls back to a slow path (about 4x
    slower than this for SmolLM2 shapes); the query heads of one KV head share its K/V here
    without copying them. Softmax runs in float32.
    """
    n, num_heads, _, head_dim = q.shape
    num_kv_heads, length = k.shape[2], k.shape[1]
    group = num_heads // num_kv_heads
    scores = torch.matmul(q.view(n, num_kv_heads, group, head_dim), k.permute(0, 2, 3, 1))
    scores = scores.float().mul_(scale)  # [N, Hkv, group, L]
    scores.masked_fill_(~mask.view(n, 1, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [N, Hkv, group, D]
    return out.reshape(n, num_heads, 1, head_dim)
