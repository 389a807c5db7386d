"""Slot-mapping K/V scatter against its twin: exact copies, padding slots skipped."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, to_device
from kvasir_engine.kernels import reference as ref
from kvasir_engine.kernels.kv_store import kv_store


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(1, 64, 16), (3, 128, 32)])
def test_kv_store_matches_twin(dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                               block_size: int) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads)
    num_heads, num_tokens, num_blocks = 4, 11, 5
    # K and V as strided views of a fused QKV output, as the model produces them.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    expected_k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected_v = torch.randn_like(expected_k)
    k_cache, v_cache = to_device(expected_k.clone(), expected_v.clone())
    ref.kv_store(key, value, expected_k, expected_v, slots)
    k, v, s = to_device(key, value, slots)
    kv_store(k, v, k_cache, v_cache, s)
    assert torch.equal(k_cache.cpu(), expected_k)
    assert torch.equal(v_cache.cpu(), expected_v)


def test_kv_store_rejects_bad_arguments() -> None:
    k_cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="key"):
        kv_store(key[:, :1], key[:, :1], k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_store(key, key, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        kv_store(key, key, k_cache.transpose(0, 1), k_cache.transpose(0, 1), slots)
    with pytest.raises(ValueError, match="last dimension"):
        kv_store(key.transpose(1, 2).contiguous().transpose(1, 2), key, k_cache, k_cache.clone(),
                 slots)
