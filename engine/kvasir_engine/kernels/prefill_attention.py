"""Paged attention for prefill chunks over a ragged batch (decode tokens are chunks of one).

Request r owns query tokens [qsl[r], qsl[r+1]); they are the last q_len positions of its
seq_len-token context, whose K/V (this chunk's included: the backend stores first) sit in the
paged cache. Query i of the chunk sees keys 0 .. seq_len - q_len + i: full over the cached
prefix, causal within the chunk. One program per (request, query head, tile of BLOCK_M query
tokens) streams K/V tiles of BLOCK_N tokens through the block table with an online softmax, and
stops at the tile's causal bound. A tile may span several KV blocks (any block size works).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvasir_engine.kernels.checks import (
    INDEX_DTYPES,
    check_head_dim,
    check_kv_cache,
    check_last_dim_contiguous,
    check_tensor,
)
from kvasir_engine.kernels.matmul import dot_precision, matmul, needs_upcast


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int32) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
        num_cached = seq_len - q_len
        kv_head = head // GROUP
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = m < q_len
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=m_mask[:, None], other=0.0)  # [BLOCK_M, D]
        q_pos = num_cached + m

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_end = tl.minimum(seq_len, num_cached + (tile + 1) * BLOCK_M)
        # Key 0 is in the first tile and visible to every row, so m_i is finite after it.
        for n0 in range(0, kv_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < kv_end
            block_ids = tl.load(block_tables_ptr + req * stride_bt + n // BLOCK_SIZE,
                                mask=n_mask, other=0).to(tl.int64)
            offs = block_ids * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
            k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
            scores = matmul(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale  # [BLOCK_M, BLOCK_N]
            visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + matmul(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
            m_i = m_new

        result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def paged_prefill_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, B] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    scale: float,
    *,
    max_query_len: int,
    block_m: int = 32,
    block_n: int = 32,
    out: torch.Tensor | None = None,  # [T, H, D]
) -> torch.Tensor:  # [T, H, D]
    """`max_query_len` bounds every chunk length; it sets the number of query tiles."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_head_dim(head_dim)
    check_tensor("query", query, (None, None, head_dim), (k_cache.dtype,), k_cache.device)
    check_last_dim_contiguous("query", query)
    num_tokens, num_heads, _ = query.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    check_tensor("seq_lens", seq_lens, (None,), INDEX_DTYPES, query.device)
    num_reqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, (num_reqs + 1,), INDEX_DTYPES, query.device)
    check_tensor("block_tables", block_tables, (num_reqs, None), INDEX_DTYPES, query.device)
    check_last_dim_contiguous("block_tables", block_tables)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    if out is None:
        out = torch.empty_like(query)
    check_tensor("out", out, tuple(query.shape), (query.dtype,), query.device)
    check_last_dim_contiguous("out", out)
    if num_reqs == 0 or num_tokens == 0:
        return out
    grid = (num_reqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        scale,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype), UPCAST=needs_upcast(query.dtype),
    )
    return out
