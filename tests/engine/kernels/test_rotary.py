"""In-place rotary embedding of query and key against its twin, both layouts."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, assert_close, to_device
from kvasir_engine.kernels import reference as ref
from kvasir_engine.kernels.rotary import rotary_embedding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_matches_twin(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                             head_dim: int, is_neox: bool) -> None:
    gen = torch.Generator().manual_seed(num_heads)
    cache = ref.rope_cos_sin_cache(4096, head_dim, theta=500000.0)
    positions = torch.tensor([0, 1, 17, 4095, 300])
    # Query and key as strided views of one fused QKV output.
    qkv = torch.randn(5, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    query, key = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    expected_q, expected_k = ref.rotary_embedding(positions, query, key, cache, is_neox)
    fused, pos, cos_sin = to_device(qkv.clone(), positions, cache)
    rotary_embedding(pos, fused[:, :num_heads], fused[:, num_heads:num_heads + num_kv_heads],
                     cos_sin, is_neox)
    assert_close(fused[:, :num_heads], expected_q)
    assert_close(fused[:, num_heads:num_heads + num_kv_heads], expected_k)
    assert torch.equal(fused[:, num_heads + num_kv_heads:].cpu(), qkv[:, num_heads + num_kv_heads:])


def test_rotary_rejects_bad_arguments() -> None:
    q = torch.randn(2, 4, 64, device=DEVICE)
    k = torch.randn(2, 2, 64, device=DEVICE)
    cache = ref.rope_cos_sin_cache(8, 64).to(DEVICE)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(torch.tensor([0], device=DEVICE), q, k, cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(torch.tensor([0, 1], device=DEVICE), q, k, cache[:, :32])
    with pytest.raises(ValueError, match="key"):
        rotary_embedding(torch.tensor([0, 1], device=DEVICE), q, k.half(), cache)
