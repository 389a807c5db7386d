"""Paged attention in plain PyTorch: the CPU path and the numerical reference for the kernels.

Each step first scatters the new K/V into their cache slots, then every request attends over
its whole context gathered from its block table: causal within its new tokens, full over the
cached prefix. Decoding requests (one query each) are batched: one padded gather and one
masked attention call per bucket of similar context lengths; requests with several new tokens (prefill chunks) are attended one
at a time, which is cheap next to their matmuls. Float32 runs SDPA everywhere (the exactness
reference); bfloat16/float16 use grouped matmuls with a float32 softmax instead, because CPU
SDPA with a mask and GQA falls back to a math path that is 2-4x slower in those dtypes.

Gathers use `index_select` on whole blocks: on CPU it is several times faster than advanced
indexing (`cache[tables]`), which goes through the generic TensorIterator gather. What every
layer of a step shares (block ids, padding masks) is built once per step, in a `_DecodePlan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvasir_engine.attention.metadata import AttentionMetadata

# What one more decode bucket costs per layer (about ten small ops), in padded context
# positions of one row, the unit its gathers and matmuls scale with (measured on CPU, bf16).
BUCKET_COST_POSITIONS = 1024


@dataclass(frozen=True)
class _DecodeBucket:
    """Decode rows of similar context length, laid out for a padded gather of whole blocks."""

    token_index: torch.Tensor  # [N] int64: each row's token in the batch
    block_ids: torch.Tensor  # [N * num_blocks] int64, padded with block 0
    # Float32 [N, num_heads, num_blocks * block_size * num_kv_heads]: 0 where query head h may
    # see (position, kv head), -inf past the context or for another head group's kv head.
    bias: torch.Tensor | None
    # Float32 / SDPA path: bool [N, 1, 1, max_len], True inside the context.
    mask: torch.Tensor | None
    max_len: int


@dataclass(frozen=True)
class _DecodePlan:
    rows: frozenset[int]  # requests that decode one token this step
    buckets: list[_DecodeBucket]
    is_whole_batch: bool  # one bucket holding every token of the batch, in order


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        # The last step's plan, keyed by its metadata object: all layers of a forward pass
        # share one metadata instance, so the plan is built by the first layer only.
        self._plan_key: tuple[AttentionMetadata, int, int, torch.dtype] | None = None
        self._plan: _DecodePlan | None = None

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
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        plan = self._decode_plan(meta, query, k_cache)
        if plan is not None and plan.is_whole_batch:
            return _decode_batch(query, k_cache, v_cache, plan.buckets[0], scale)
        out = torch.empty_like(query)
        done: frozenset[int] = frozenset()
        if plan is not None:
            for bucket in plan.buckets:
                index = bucket.token_index
                out.index_copy_(0, index, _decode_batch(query.index_select(0, index), k_cache,
                                                        v_cache, bucket, scale))
            done = plan.rows
        for i in range(meta.num_reqs):
            if i in done:
                continue
            start, end = qsl[i], qsl[i + 1]
            k, v = _gather(k_cache, v_cache, meta.block_tables[i], seq_lens[i])
            out[start:end] = _attend(query[start:end], k, v, seq_lens[i], scale)
        return out

    def _decode_plan(self, meta: AttentionMetadata, query: torch.Tensor,
                     k_cache: torch.Tensor) -> _DecodePlan | None:
        key = (meta, query.shape[1], k_cache.shape[2], query.dtype)
        if self._plan_key is not None and self._plan_key[0] is meta \
                and self._plan_key[1:] == key[1:]:
            return self._plan
        plan = build_decode_plan(meta, query.shape[1], k_cache.shape[2], k_cache.shape[1],
                                 query.dtype)
        self._plan_key, self._plan = key, plan
        return plan


def build_decode_plan(meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
                      block_size: int, dtype: torch.dtype) -> _DecodePlan | None:
    """None when no request decodes (or, in float32, fewer than two: SDPA alone is as fast).

    Float32 keeps all rows in one bucket (its results stay those of one padded SDPA call);
    other dtypes split rows by context length so short contexts are not padded to the longest.
    """
    qsl = meta.query_start_loc_cpu
    rows = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
    if len(rows) < (2 if dtype == torch.float32 else 1):
        return None
    if dtype == torch.float32 or len(rows) == 1:
        groups = [rows]
    else:
        groups = split_by_length(rows, meta.seq_lens_cpu, block_size)
    buckets = [_bucket(meta, group, num_heads, num_kv_heads, block_size, dtype)
               for group in groups]
    return _DecodePlan(frozenset(rows), buckets, len(groups) == 1 and len(rows) == qsl[-1])


def split_by_length(rows: list[int], seq_lens: tuple[int, ...],
                    block_size: int) -> list[list[int]]:
    """Rows grouped by context length, cut where the padding saved beats a bucket's cost;
    each group keeps batch order, so one group of every row is the batch itself.

    Exact over the distinct block counts (at most 48 groups kept; more are merged), by dynamic
    programming: best[j] = min over i of best[i] + cost(rows of groups i..j padded to group j).
    """
    order = sorted(rows, key=lambda r: seq_lens[r])
    num_blocks = [-(-seq_lens[r] // block_size) for r in order]
    ends = [i + 1 for i in range(len(order)) if i + 1 == len(order)
            or num_blocks[i + 1] != num_blocks[i]]
    if len(ends) > 48:
        ends = [ends[round((k + 1) * len(ends) / 48) - 1] for k in range(48)]
    best, cut = [0.0], [0]
    for j, end in enumerate(ends):
        width = num_blocks[end - 1] * block_size
        options = [best[i] + BUCKET_COST_POSITIONS + (end - start) * width
                   for i, start in enumerate([0, *ends[:j]])]
        i = min(range(len(options)), key=options.__getitem__)
        best.append(options[i])
        cut.append(i)
    groups, j = [], len(ends)
    while j > 0:
        i = cut[j]
        groups.append(sorted(order[(ends[i - 1] if i else 0):ends[j - 1]]))
        j = i
    return groups[::-1]


def _bucket(meta: AttentionMetadata, rows: list[int], num_heads: int, num_kv_heads: int,
            block_size: int, dtype: torch.dtype) -> _DecodeBucket:
    device = meta.block_tables.device
    qsl = meta.query_start_loc_cpu
    seq_lens = [meta.seq_lens_cpu[i] for i in rows]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    token_index = torch.tensor([qsl[i] for i in rows], device=device)
    if rows == list(range(meta.num_reqs)):
        tables = meta.block_tables
    else:
        tables = meta.block_tables.index_select(0, torch.tensor(rows, device=device))
    block_ids = tables[:, :num_blocks].reshape(-1).to(torch.int64)
    lens = torch.tensor(seq_lens, device=device).unsqueeze(1)
    if dtype == torch.float32:
        mask = (torch.arange(max_len, device=device).unsqueeze(0) < lens)[:, None, None, :]
        return _DecodeBucket(token_index, block_ids, None, mask, max_len)
    padded = num_blocks * block_size
    outside = torch.arange(padded, device=device).unsqueeze(0) >= lens  # [N, L]
    group = num_heads // num_kv_heads
    head_kv = torch.arange(num_heads, device=device) // group
    other_head = head_kv.unsqueeze(1) != torch.arange(num_kv_heads, device=device)  # [H, Hkv]
    hidden = outside[:, None, :, None] | other_head[None, :, None, :]  # [N, H, L, Hkv]
    bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))
    return _DecodeBucket(token_index, block_ids,
                         bias.view(len(rows), num_heads, padded * num_kv_heads), None, max_len)


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
    k = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int,
            scale: float) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of a seq_len context; k, v [seq_len, Hkv, D]."""
    num_queries = q.shape[0]
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device).unsqueeze(1)
    mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # [Q, seq_len]
    if q.dtype != torch.float32:
        return _grouped_attend(q, k, v, mask, scale)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def _grouped_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [Q, H, D], k/v [L, Hkv, D], mask [Q, L] -> [Q, H, D]: one matmul per KV head, whose
    query heads are stacked along the rows, so K and V are never repeated per query head."""
    num_queries, num_heads, head_dim = q.shape
    length, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    q = q.view(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * num_queries, head_dim)
    scores = torch.bmm(q, k.permute(1, 2, 0)).float().mul_(scale)  # [Hkv, group * Q, L]
    scores = scores.view(num_kv_heads, group, num_queries, length).masked_fill_(
        ~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_kv_heads, -1, length)
    out = torch.bmm(probs, v.transpose(0, 1))  # [Hkv, group * Q, D]
    return out.view(num_kv_heads, group, num_queries, head_dim).permute(2, 0, 1, 3).reshape(
        num_queries, num_heads, head_dim)


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  plan: _DecodeBucket, scale: float) -> torch.Tensor:
    """q [N, H, D], one query per request -> [N, H, D]: contexts padded to the longest."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache.index_select(0, plan.block_ids)  # [N * nb, block_size, Hkv, D]
    v = v_cache.index_select(0, plan.block_ids)
    if plan.bias is None:
        k = k.view(n, -1, num_kv_heads, head_dim)[:, :plan.max_len]
        v = v.view(n, -1, num_kv_heads, head_dim)[:, :plan.max_len]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.mask,
            scale=scale, enable_gqa=num_heads != num_kv_heads)
        return out.squeeze(2)
    return _all_heads_decode(q, k.view(n, -1, head_dim), v.view(n, -1, head_dim), plan.bias,
                             scale)


def _all_heads_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [N, H, D]; k, v [N, L * Hkv, D] exactly as gathered; bias [N, H, L * Hkv] -> [N, H, D].

    Every query head is scored against every (position, kv head) pair and the pairs of other
    head groups get -inf, so their softmax weight is exactly 0. That costs Hkv times the (tiny)
    FLOPs but reads K and V in the cache's own layout: the grouped formulation needs a
    transposing copy of K and V of the whole batch first, and on CPU that copy costs more than
    the matmuls. Softmax runs in float32.
    """
    scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale).add_(bias)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, v)
