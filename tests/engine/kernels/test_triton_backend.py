"""The Triton attention backend (interpreted on CPU) against the model engineer's torch backend."""

from __future__ import annotations

import pytest
import torch
from helpers import attention_step
from kernel_cases import assert_close
from kvasir_engine.attention.torch_backend import TorchAttentionBackend
from kvasir_engine.attention.triton_backend import TritonAttentionBackend


@pytest.mark.parametrize(("dtype", "plan"), [
    (torch.float32, [(0, 9), (21, 12), (40, 1), (7, 1)]),  # mixed prefill + decode
    (torch.bfloat16, [(0, 1), (33, 1), (70, 1)]),  # decode only
    (torch.float16, [(16, 17), (0, 3)]),
])
def test_triton_backend_matches_torch_backend(dtype: torch.dtype,
                                              plan: list[tuple[int, int]]) -> None:
    gen = torch.Generator().manual_seed(len(plan))
    block_size, num_heads, num_kv_heads, head_dim, num_blocks = 16, 8, 2, 64, 24
    meta, _ = attention_step(plan, block_size, num_blocks, gen)
    num_tokens = meta.query_start_loc_cpu[-1]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # A cache already holding earlier tokens: identical starting contents for both backends.
    k_cache, v_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    caches = {name: (k_cache.clone(), v_cache.clone()) for name in ("torch", "triton")}
    expected = TorchAttentionBackend().forward(query, key, value, *caches["torch"], meta, 0.125)
    out = TritonAttentionBackend(decode_partition_size=32).forward(
        query, key, value, *caches["triton"], meta, 0.125)
    assert_close(out, expected)
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])
