"""Rotary position embedding of query and key in place, both in one launch per token.

`cos_sin_cache` is [max_position, head_dim]: cos of the head_dim/2 frequencies, then their sin
(any RoPE scaling is already folded into it). Neox style rotates the two halves of a head
(Hugging Face Llama layout); GPT-J style rotates adjacent pairs (llama.cpp's layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvasir_engine.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_head_dim,
    check_last_dim_contiguous,
    check_tensor,
)


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, token, cos, sin,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  IS_NEOX: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    if IS_NEOX:
        first, second = i, i + HALF
    else:
        first, second = 2 * i, 2 * i + 1
    mask = (h < NUM_HEADS)[:, None]
    base = ptr + token * stride_t + h[:, None] * stride_h
    x1 = tl.load(base + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(base + first[None, :], (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + second[None, :], (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_KH: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i)[None, :].to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i)[None, :].to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, cos, sin, NUM_HEADS, BLOCK_H, HALF, IS_NEOX)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, cos, sin, NUM_KV_HEADS, BLOCK_KH, HALF,
                  IS_NEOX)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, H, D], rotated in place
    key: torch.Tensor,  # [T, KH, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, D]
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("query", query, (None, None, None), FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = query.shape
    check_head_dim(head_dim)
    check_tensor("key", key, (num_tokens, None, head_dim), (query.dtype,), query.device)
    check_tensor("positions", positions, (num_tokens,), INDEX_DTYPES, query.device)
    check_tensor("cos_sin_cache", cos_sin_cache, (None, head_dim), FLOAT_DTYPES, query.device)
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return query, key
    num_kv_heads = key.shape[1]
    _rotary_kernel[(num_tokens,)](
        query, key, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, BLOCK_H=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads, BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2, IS_NEOX=is_neox,
    )
    return query, key
