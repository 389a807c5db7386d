"""Paged attention in plain PyTorch: the CPU path and the numerical reference for the kernels.

Each step first scatters the new K/V into their cache slots, then every request attends over
its whole context gathered from its block table: causal within its new tokens, full over the
cached prefix. Decoding requests (one query each) are batched in buckets of similar context
length; requests with several new tokens (prefill chunks) are attended one at a time, in
chunks of queries that score only the keys they can see (never the causal half). What every
layer of a step shares (block ids, masks, row indices) is built once per step, in a
`_DecodePlan`.

With `native_decode` (the process's `KernelChoice.decode_attention == "native"`: x86 CPUs with
the native kernels of kernels/cpu.py, float32/bfloat16 queries and caches, head_dim a multiple
of 8), decode rows take one native call per layer instead (`_NativeDecode`); what follows is
the path everywhere else, and the prefill path everywhere.

Float32 runs SDPA everywhere (the exactness reference: one padded bucket). bfloat16/float16
prefill runs SDPA where the process's `KernelChoice.prefill_attention` says so (CPUs with
AMX, where oneDNN's flash kernel is ~3x faster than the chunks below at 64 to 2048 positions,
measured on a 2-core Xeon), the native flash kernel of kernels/csrc/cpu_prefill.cpp where it
says "native" (bfloat16 queries and caches on AVX512-BF16 CPUs without AMX: K and V read in
place, float32 scores; 0.26-0.65x the chunks' time at 64-500 positions on a 2-core EPYC),
and plain matmuls in chunks of queries elsewhere (on the AVX2 and AVX-512 hosts measured
earlier CPU SDPA in those dtypes was 2-4x slower). Their decode, per
layer:
- one `index_select` of whole blocks gathers every bucket's K, in the cache's own layout;
- one matmul per bucket scores each query head against every KV head's slice of a position
  (the query is zero outside its own head's slice): Hkv times the (tiny) FLOPs, but no
  transposing copy of K, which costs more than the matmul on CPU;
- softmax in the compute dtype (the kernel accumulates in float32; the scores were rounded to
  it by the matmul in any case);
- one `embedding_bag` forms the weighted sum of V rows straight from the cache (float32
  accumulation): V is never gathered, and each query head reads only its own KV head's rows.
Gathers use `index_select` on whole blocks: on CPU it is several times faster than advanced
indexing (`cache[tables]`), which goes through the generic TensorIterator gather.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvasir_engine.attention.invariant import InvariantRows, invariant_attention, invariant_rows
from kvasir_engine.attention.metadata import AttentionMetadata
from kvasir_engine.kernels import cpu

# What one more decode bucket costs per layer (a oneDNN matmul, ~15 us before any work, and a
# softmax), in padded context positions of one row, the unit its K gather and scores scale
# with (measured on CPU, bf16, SmolLM2 shapes, contexts that grow step by step: 512 to 4096
# are within noise of each other).
BUCKET_COST_POSITIONS = 1024
# Prefill queries scored per matmul: few enough to skip most of the causal half and keep the
# scores cache-sized, enough that the per-chunk ops stay negligible (measured at 64..2048).
PREFILL_QUERY_CHUNK = 128


@dataclass(frozen=True)
class _DecodeBucket:
    """Plan rows [row_start, row_end), each padded to padded_len positions (whole blocks)."""

    row_start: int
    row_end: int
    position_start: int  # its first row's first position in the gathered K of the plan
    padded_len: int
    bias: torch.Tensor  # [rows, 1, padded_len]: 0 inside each row's context, -inf past it

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def position_end(self) -> int:
        return self.position_start + self.num_rows * self.padded_len


@dataclass(frozen=True)
class _SdpaDecode:
    """Float32: one padded SDPA call over the gathered K and V."""

    mask: torch.Tensor  # bool [N, 1, 1, max_len], True inside the context


@dataclass(frozen=True)
class _MatmulDecode:
    """bfloat16/float16: scores per bucket against the gathered K, weighted sum of V rows."""

    buckets: tuple[_DecodeBucket, ...]
    head_mask: torch.Tensor  # [1, Hkv, 1, Hkv, 1] identity: query head (kv, g) to slice kv
    # The weighted sum over V as one `embedding_bag` over the rows of v_cache.view(-1, D).
    # Bags of (plan row n, query head h), bucket after bucket and laid out like the
    # probabilities ([rows, H, padded_len] each): the row of (position, h's KV head). Padded
    # positions weigh exactly 0 (softmax of -inf) and read rows of the context's last block or
    # of block 0, which stay in cache: cheaper than cutting bags and weights to the contexts.
    value_rows: torch.Tensor  # int32 when the cache allows
    value_offsets: torch.Tensor  # [N * H + 1]: where the bag of (n, h) starts

    @property
    def num_positions(self) -> int:
        return self.buckets[-1].position_end


@dataclass(frozen=True)
class _NativeDecode:
    """x86 CPUs (float32/bfloat16): one native kernel call per layer, reading K and V through
    the plan rows' block tables (kernels/cpu.py); no gathers, no padding."""

    block_tables: torch.Tensor  # [N, B] int32
    seq_lens: torch.Tensor  # [N] int32
    max_len: int


@dataclass(frozen=True)
class _DecodePlan:
    rows: frozenset[int]  # requests that decode one token this step
    # [N] int64: the batch token of each plan row; None when the plan rows are the batch.
    token_index: torch.Tensor | None
    block_ids: torch.Tensor  # [sum of rows * blocks] int64: bucket after bucket, 0-padded
    method: _SdpaDecode | _MatmulDecode | _NativeDecode


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, native_decode: bool = False, sdpa_prefill: bool = False,
                 native_prefill: bool = False, batch_invariant: bool = False) -> None:
        self.native_decode = native_decode
        # --batch-invariant: every token a row of attention/invariant.py, whatever its step
        self.batch_invariant = batch_invariant
        self._rows: tuple[AttentionMetadata, InvariantRows] | None = None
        self.sdpa_prefill = sdpa_prefill  # bfloat16/float16 prefill through SDPA
        # bfloat16 prefill over bfloat16 caches through kernels/csrc/cpu_prefill.cpp
        self.native_prefill = native_prefill
        # The last step's plan, keyed by its metadata object: all layers of a forward pass
        # share one metadata instance, so the plan is built by the first layer only.
        self._plan_key: tuple[AttentionMetadata, int, torch.Size, torch.dtype,
                              torch.dtype] | None = None
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
        if self.batch_invariant:
            if self._rows is None or self._rows[0] is not meta:  # once per forward pass
                self._rows = (meta, invariant_rows(meta))
            return invariant_attention(query, k_cache, v_cache, self._rows[1], scale,
                                       self.native_decode)
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        plan = self._decode_plan(meta, query, k_cache)
        if plan is not None and plan.token_index is None:
            return _decode(query, k_cache, v_cache, plan, scale)
        out = torch.empty_like(query)
        done: frozenset[int] = frozenset()
        if plan is not None and plan.token_index is not None:
            index = plan.token_index
            out.index_copy_(0, index, _decode(query.index_select(0, index), k_cache, v_cache,
                                              plan, scale))
            done = plan.rows
        native = (self.native_prefill and query.dtype == k_cache.dtype == torch.bfloat16)
        for i in range(meta.num_reqs):
            if i in done:
                continue
            start, end = qsl[i], qsl[i + 1]
            if native:  # K and V read in place through the block table
                out[start:end] = cpu.prefill_attention(query[start:end], k_cache, v_cache,
                                                       meta.block_tables[i], seq_lens[i], scale)
                continue
            k, v = _gather(k_cache, v_cache, meta.block_tables[i], seq_lens[i], query.dtype)
            out[start:end] = _attend(query[start:end], k, v, seq_lens[i], scale,
                                     self.sdpa_prefill)
        return out

    def _decode_plan(self, meta: AttentionMetadata, query: torch.Tensor,
                     k_cache: torch.Tensor) -> _DecodePlan | None:
        key = (meta, query.shape[1], k_cache.shape, query.dtype, k_cache.dtype)
        if self._plan_key is not None and self._plan_key[0] is meta \
                and self._plan_key[1:] == key[1:]:
            return self._plan
        plan = build_decode_plan(meta, query.shape[1], k_cache.shape, query.dtype,
                                 self.native_decode)
        self._plan_key, self._plan = key, plan
        return plan


def build_decode_plan(meta: AttentionMetadata, num_heads: int, cache_shape: torch.Size,
                      dtype: torch.dtype, native: bool = False) -> _DecodePlan | None:
    """None when no request decodes (or, in float32, fewer than two: SDPA alone is as fast).
    `dtype` is the compute dtype; `native`: decode rows go to the native kernel (the caller's
    kernel choice).

    Float32 keeps all rows in one bucket (its results stay those of one padded SDPA call);
    other dtypes split rows by context length so short contexts are not padded to the longest.
    """
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    block_size = cache_shape[1]
    rows = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
    if rows and native:
        return _native_decode_plan(meta, rows)
    is_float32 = dtype == torch.float32
    if len(rows) < (2 if is_float32 else 1):
        return None
    groups = [rows] if is_float32 else split_by_length(rows, seq_lens, block_size)
    order = [r for group in groups for r in group]
    device = meta.block_tables.device
    token_index = None
    if order != list(range(meta.num_reqs)) or len(rows) != qsl[-1]:
        token_index = torch.tensor([qsl[r] for r in order], device=device)
    lens = [[seq_lens[r] for r in group] for group in groups]
    width = meta.block_tables.shape[1]
    table_index = [r * width + b for group, group_lens in zip(groups, lens, strict=True)
                   for r in group for b in range(-(-max(group_lens) // block_size))]
    block_ids = meta.block_tables.reshape(-1).index_select(
        0, torch.tensor(table_index, device=device)).to(torch.int64)
    if is_float32:
        context_lens = torch.tensor(lens[0], device=device).unsqueeze(1)
        inside = torch.arange(max(lens[0]), device=device) < context_lens  # [N, max_len]
        return _DecodePlan(frozenset(rows), token_index, block_ids,
                           _SdpaDecode(inside[:, None, None, :]))
    return _DecodePlan(frozenset(rows), token_index, block_ids,
                       _matmul_decode_plan(lens, block_ids, num_heads, cache_shape, dtype))


def _native_decode_plan(meta: AttentionMetadata, rows: list[int]) -> _DecodePlan:
    device = meta.block_tables.device
    if rows == list(range(meta.num_reqs)) and len(rows) == meta.query_start_loc_cpu[-1]:
        token_index, tables, seq_lens = None, meta.block_tables, meta.seq_lens
    else:
        index = torch.tensor(rows, device=device)
        token_index = torch.tensor([meta.query_start_loc_cpu[r] for r in rows], device=device)
        tables = meta.block_tables.index_select(0, index)
        seq_lens = meta.seq_lens.index_select(0, index)
    max_len = max(meta.seq_lens_cpu[r] for r in rows)
    return _DecodePlan(frozenset(rows), token_index, torch.empty(0, dtype=torch.int64),
                       _NativeDecode(tables.to(torch.int32).contiguous(),
                                     seq_lens.to(torch.int32).contiguous(), max_len))


def _matmul_decode_plan(lens: list[list[int]], block_ids: torch.Tensor, num_heads: int,
                        cache_shape: torch.Size, dtype: torch.dtype) -> _MatmulDecode:
    """Buckets of the rows' context lengths `lens`, whose blocks are `block_ids`."""
    num_blocks, block_size, num_kv_heads = cache_shape[0], cache_shape[1], cache_shape[2]
    device = block_ids.device
    kv_of_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    buckets: list[_DecodeBucket] = []
    value_rows, bag_lengths = [], []
    row_start = position = 0
    for bucket_lens in lens:
        num_rows, padded = len(bucket_lens), -(-max(bucket_lens) // block_size) * block_size
        context_lens = torch.tensor(bucket_lens, device=device).unsqueeze(1)
        past = torch.arange(padded, device=device) >= context_lens  # [rows, padded]
        bias = torch.zeros(num_rows, 1, padded, dtype=dtype, device=device).masked_fill_(
            past.unsqueeze(1), float("-inf"))
        buckets.append(_DecodeBucket(row_start, row_start + num_rows, position, padded, bias))
        blocks = block_ids[position // block_size:(position + num_rows * padded) // block_size]
        slots = (blocks.view(num_rows, -1, 1) * block_size
                 + torch.arange(block_size, device=device)).view(num_rows, 1, padded)
        value_rows.append((slots * num_kv_heads + kv_of_head.unsqueeze(1)).view(-1))  # [n, H, L]
        bag_lengths += [padded] * (num_rows * num_heads)
        row_start += num_rows
        position += num_rows * padded
    is_small = max(num_blocks * block_size * num_kv_heads, position * num_heads) < 2**31
    index_dtype = torch.int32 if is_small else torch.int64
    head_mask = torch.eye(num_kv_heads, dtype=dtype, device=device)
    return _MatmulDecode(
        tuple(buckets), head_mask.view(1, num_kv_heads, 1, num_kv_heads, 1),
        torch.cat(value_rows).to(index_dtype),
        torch.tensor([0, *itertools.accumulate(bag_lengths)], dtype=index_dtype, device=device))


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


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's K/V into flat slot slot_mapping[t] of the paged cache."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len tokens of one request's K and V: [seq_len, Hkv, D] each, in the
    compute dtype (a no-op unless the cache has a dtype of its own)."""
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)]
    k = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    return k.to(dtype), v.to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int,
            scale: float, sdpa: bool = False) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of a seq_len context; k, v [seq_len, Hkv, D];
    `sdpa`: bfloat16/float16 through SDPA too (float32 always is)."""
    if q.dtype != torch.float32 and not sdpa:
        return _chunked_attend(q, k, v, scale)
    num_queries = q.shape[0]
    mask = None
    if num_queries < seq_len:  # a cached prefix: query i sees the prefix and queries <= i
        q_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # [Q, seq_len]
    # [1, heads, positions, D]: CPU SDPA takes its flash kernel for 4-D inputs only (3-D ones
    # go to the math path, several times slower).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def _chunked_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [Q, H, D], the last Q of L positions; k/v [L, Hkv, D] -> [Q, H, D].

    One matmul per chunk of queries for all KV heads, each KV head's query heads stacked along
    the rows (K and V are never repeated per query head); a chunk scores only the keys up to
    its last query, so the scores never hold the causal half nor grow with Q * L.
    """
    num_queries, num_heads, head_dim = q.shape
    length, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.transpose(0, 1).contiguous()  # [Hkv, L, D]
    v = v.transpose(0, 1).contiguous()
    q = q.view(num_queries, num_kv_heads, group, head_dim).transpose(0, 1).reshape(
        num_kv_heads, num_queries * group, head_dim)  # rows ordered (query, head in group)
    out = torch.empty_like(q)
    first = length - num_queries  # the position of query 0
    positions = torch.arange(length, device=q.device)
    for start in range(0, num_queries, PREFILL_QUERY_CHUNK):
        end = min(start + PREFILL_QUERY_CHUNK, num_queries)
        seen = first + end  # the keys the chunk's last query sees
        hidden = positions[:seen] > positions[first + start:seen].unsqueeze(1)  # [chunk, seen]
        bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(
            hidden, float("-inf")).repeat_interleave(group, dim=0)
        rows = slice(start * group, end * group)
        scores = torch.baddbmm(bias, q[:, rows], k[:, :seen].transpose(1, 2), alpha=scale)
        torch.bmm(torch.softmax(scores, dim=-1), v[:, :seen], out=out[:, rows])
    return out.view(num_kv_heads, num_queries, group, head_dim).transpose(0, 1).reshape(
        num_queries, num_heads, head_dim)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            plan: _DecodePlan, scale: float) -> torch.Tensor:
    """q [N, H, D], one query per plan row -> [N, H, D]."""
    if isinstance(plan.method, _NativeDecode):
        m = plan.method
        return cpu.decode_attention(q, k_cache, v_cache, m.block_tables, m.seq_lens,
                                          m.max_len, scale)
    # [N * blocks, block_size, Hkv, D]; a cache of its own dtype only reaches here in float32
    k = k_cache.index_select(0, plan.block_ids).to(q.dtype)
    if isinstance(plan.method, _SdpaDecode):
        v = v_cache.index_select(0, plan.block_ids).to(q.dtype)
        return _sdpa_decode(q, k, v, plan.method, scale)
    return _matmul_decode(q, k, v_cache, plan.method, scale)


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: _SdpaDecode,
                 scale: float) -> torch.Tensor:
    """q [N, H, D]; k, v [N * blocks, block_size, Hkv, D] as gathered -> [N, H, D]."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, max_len = k.shape[2], method.mask.shape[-1]
    k = k.view(n, -1, num_kv_heads, head_dim)[:, :max_len]
    v = v.view(n, -1, num_kv_heads, head_dim)[:, :max_len]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=method.mask,
        scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out.squeeze(2)


def _matmul_decode(q: torch.Tensor, k: torch.Tensor, v_cache: torch.Tensor,
                   method: _MatmulDecode, scale: float) -> torch.Tensor:
    """q [N, H, D]; k [N * blocks, block_size, Hkv, D] as gathered -> [N, H, D]."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    width = num_kv_heads * head_dim
    k = k.view(-1, width)  # [positions, Hkv * D]
    # [N, H, Hkv * D]: query head (kv, g) holds its vector in slice kv, zeros elsewhere.
    q = (q.view(n, num_kv_heads, -1, 1, head_dim) * method.head_mask).view(n, num_heads, width)
    weights = q.new_empty(method.num_positions * num_heads)  # the probabilities, flattened
    for bucket in method.buckets:
        keys = k[bucket.position_start:bucket.position_end].view(
            bucket.num_rows, bucket.padded_len, width)
        scores = torch.baddbmm(bucket.bias, q[bucket.row_start:bucket.row_end],
                               keys.transpose(1, 2), alpha=scale)  # [rows, H, padded_len]
        torch.softmax(scores, dim=-1, out=weights[
            bucket.position_start * num_heads:bucket.position_end * num_heads].view_as(scores))
    out = F.embedding_bag(method.value_rows, v_cache.view(-1, head_dim), method.value_offsets,
                          mode="sum", per_sample_weights=weights, include_last_offset=True)
    return out.view(n, num_heads, head_dim)
