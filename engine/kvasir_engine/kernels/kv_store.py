"""Scatter this step's K/V into their paged-cache slots (slot = block_id * block_size + offset).

One program per token copies all of its KV heads; a negative slot (a CUDA-graph padding token)
is skipped. `key`/`value` may be strided views of a fused QKV projection: only the head dim
must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvasir_engine.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_kv_cache,
    check_last_dim_contiguous,
    check_tensor,
)


@triton.jit
def _kv_store_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        dst_offs = dst + h[:, None] * stride_ch + d[None, :]
        k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(v_cache_ptr + dst_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_store(
    key: torch.Tensor,  # [T, KH, D]
    value: torch.Tensor,  # [T, KH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D], written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("key", key, (None, num_kv_heads, head_dim), FLOAT_DTYPES, k_cache.device)
    check_tensor("value", value, tuple(key.shape), FLOAT_DTYPES, k_cache.device)
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    num_tokens = key.shape[0]
    check_tensor("slot_mapping", slot_mapping, (num_tokens,), INDEX_DTYPES, k_cache.device)
    if num_tokens == 0:
        return
    _kv_store_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
    )
