"""Paged attention for decode: one query token per request against its block table.

Flash-decoding: the context of each request is cut into partitions of `partition_size` tokens,
one program per (request, KV head, partition). A program loads each K/V tile once for all
`num_heads / num_kv_heads` query heads of its KV head (GQA), runs an online softmax, and writes
its partial output with its log-sum-exp; a second kernel merges the partitions stably
(weights exp(lse_s - max lse)). With one partition the first kernel writes the output directly.

Napkin maths: decode reads every cached K/V byte once, so its time is
2 * seq_len * num_kv_heads * head_dim * dtype_bytes / HBM bandwidth per layer and request;
`bench/gpu_check.py` measures the achieved fraction of peak.

The grid depends on `max_seq_len` only through the partition count, so a CUDA graph captured
with `max_seq_len = max_model_len` stays valid for every shorter batch (empty partitions write
lse = -inf and weigh nothing; a request with seq_len 0, a graph's padding slot, gets zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvasir_engine.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_head_dim,
    check_kv_cache,
    check_last_dim_contiguous,
    check_tensor,
)
from kvasir_engine.kernels.matmul import dot_precision, matmul, needs_upcast


@triton.jit
def _decode_partition_kernel(
    out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale,
    stride_qr, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_or, stride_oh, stride_os,
    stride_lr, stride_lh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
    IS_SINGLE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    start = part * PARTITION
    end = tl.minimum(start + PARTITION, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + req * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)  # [BLOCK_G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block_ids = tl.load(block_tables_ptr + req * stride_bt + n // BLOCK_SIZE,
                            mask=n_mask, other=0).to(tl.int64)
        offs = block_ids * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        scores = matmul(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale  # [BLOCK_G, N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + matmul(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    has_ctx = l_i > 0.0
    result = tl.where(has_ctx[:, None], acc / tl.where(has_ctx, l_i, 1.0)[:, None], 0.0)
    out_offs = req * stride_or + heads[:, None] * stride_oh + part * stride_os + d[None, :]
    tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    if not IS_SINGLE:
        lse = tl.where(has_ctx, m_i + tl.log(tl.where(has_ctx, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + req * stride_lr + heads * stride_lh + part, lse, mask=g_mask)


@triton.jit
def _merge_partitions_kernel(
    out_ptr, part_out_ptr, lse_ptr,
    stride_or, stride_oh,
    stride_pr, stride_ph, stride_ps,
    stride_lr, stride_lh,
    NUM_PARTS: tl.constexpr, BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, HEAD_DIM)
    p_mask = p < NUM_PARTS
    lse = tl.load(lse_ptr + req * stride_lr + head * stride_lh + p, mask=p_mask,
                  other=float("-inf"))
    lse_max = tl.max(lse, 0)
    has = lse > float("-inf")
    weights = tl.where(has, tl.exp(tl.where(has, lse - lse_max, 0.0)), 0.0)  # [BLOCK_P]
    total = tl.sum(weights, 0)
    parts = tl.load(part_out_ptr + req * stride_pr + head * stride_ph + p[:, None] * stride_ps
                    + d[None, :], mask=p_mask[:, None], other=0.0)  # [BLOCK_P, D]
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + req * stride_or + head * stride_oh + d, merged.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    query: torch.Tensor,  # [R, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, B] int32
    seq_lens: torch.Tensor,  # [R] int32
    scale: float,
    *,
    max_seq_len: int,
    partition_size: int = 512,
    block_n: int = 32,
    out: torch.Tensor | None = None,  # [R, H, D]; written in place when given (CUDA graphs)
) -> torch.Tensor:  # [R, H, D]
    """`max_seq_len` bounds every entry of seq_lens; it only sets the partition count."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_head_dim(head_dim)
    check_tensor("query", query, (None, None, head_dim), (k_cache.dtype,), k_cache.device)
    check_last_dim_contiguous("query", query)
    num_reqs, num_heads, _ = query.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    check_tensor("block_tables", block_tables, (num_reqs, None), INDEX_DTYPES, query.device)
    check_last_dim_contiguous("block_tables", block_tables)
    check_tensor("seq_lens", seq_lens, (num_reqs,), INDEX_DTYPES, query.device)
    if block_n < 16 or block_n & (block_n - 1) or partition_size % block_n:
        raise ValueError(f"partition_size ({partition_size}) must be a multiple of block_n "
                         f"({block_n}), a power of two >= 16")
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(f"max_seq_len ({max_seq_len}) exceeds what block_tables can address "
                         f"({block_tables.shape[1]} blocks x {block_size})")
    if out is None:
        out = torch.empty_like(query)
    check_tensor("out", out, tuple(query.shape), FLOAT_DTYPES, query.device)
    check_last_dim_contiguous("out", out)
    if num_reqs == 0:
        return out

    group = num_heads // num_kv_heads
    num_parts = max(1, triton.cdiv(max_seq_len, partition_size))
    single = num_parts == 1
    if single:
        part_out, lse = out.unsqueeze(2), out.new_empty(1, dtype=torch.float32)
    else:
        part_out = query.new_empty(num_reqs, num_heads, num_parts, head_dim, dtype=torch.float32)
        lse = query.new_empty(num_reqs, num_heads, num_parts, dtype=torch.float32)
    _decode_partition_kernel[(num_reqs, num_kv_heads, num_parts)](
        part_out, lse, query, k_cache, v_cache, block_tables, seq_lens,
        scale,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        lse.stride(0) if not single else 0, lse.stride(1) if not single else 0,
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, PARTITION=partition_size,
        IS_SINGLE=single, DOT_PRECISION=dot_precision(query.dtype),
        UPCAST=needs_upcast(query.dtype),
    )
    if not single:
        _merge_partitions_kernel[(num_reqs, num_heads)](
            out, part_out, lse,
            out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            lse.stride(0), lse.stride(1),
            NUM_PARTS=num_parts, BLOCK_P=triton.next_power_of_2(num_parts), HEAD_DIM=head_dim,
        )
    return out
