"""The torch attention backend against float32 SDPA over each request's unpaged K/V.

Covers the batched decode path (all-heads scores and an embedding_bag over V in
bfloat16/float16, in one or many length buckets; padded masked SDPA in float32), decode rows
mixed with prefill chunks (the rows are then picked out of the batch), prefill chunks (grouped
matmuls over chunks of queries in bfloat16/float16, SDPA as on AMX hosts, or the native
AVX512-BF16 kernel in bfloat16; SDPA in float32), GQA groups of 1, 3 and 4,
and one backend reused across steps and layers (its per-step plan must follow the metadata it
is given). Where the native CPU kernels build, decode rows in float32/bfloat16 take the native
kernel (`_NativeDecode`); each test runs that path and the torch one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import attention_step
from kvasir_engine.attention import torch_backend
from kvasir_engine.attention.metadata import AttentionMetadata
from kvasir_engine.attention.torch_backend import (
    TorchAttentionBackend,
    build_decode_plan,
    split_by_length,
)
from kvasir_engine.kernels import cpu

BLOCK_SIZE, HEAD_DIM, SCALE = 16, 64, 0.125


@pytest.fixture(params=["native", "torch"])
def decode_kernels(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and not cpu.available():
        pytest.skip("native CPU kernels unavailable here")
    return str(request.param)


# (atol, rtol) of the output against the float32 reference. bfloat16 rounds q, K, V, the
# scores and the softmax weights to 8 mantissa bits; float32 differs only by summation order.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2),
              torch.float16: (4e-3, 4e-3)}
PLANS = [
    [(40, 1), (7, 1), (100, 1), (3, 1), (0, 1)],  # decode only, rows in batch order
    [(5, 1), (0, 9), (60, 1), (21, 12), (17, 1)],  # decode rows between prefill chunks
    [(15, 1), (16, 1), (31, 1), (32, 1)],  # context lengths on block boundaries
    [(0, 20), (90, 1)],  # one decode row (float32: the per-request path)
    # Short and long contexts: bfloat16/float16 split the decode rows into length buckets.
    [(500 + 40 * (i % 2), 1) if i % 3 else (5 + i, 1) for i in range(12)],
    [(4, 1), (600, 1), (0, 7), (9, 1), (620, 1), (3, 1), (610, 1), (2, 1), (590, 1)],
    [(36, 1)],  # a single decode row, the whole batch
    # Prefill longer than a query chunk, with and without a cached prefix.
    [(0, 300), (200, 150), (47, 1)],
]


def reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, tables: list[list[int]]) -> torch.Tensor:
    """Float32 SDPA per request over its K/V read token by token from the (written) cache."""
    out = torch.empty(query.shape, dtype=torch.float32)
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        slots = [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        k = k_cache.flatten(0, 1)[slots].float().transpose(0, 1)  # [Hkv, L, D]
        v = v_cache.flatten(0, 1)[slots].float().transpose(0, 1)
        q = query[qsl[i]:qsl[i + 1]].float().transpose(0, 1)  # [H, Q, D]
        q_pos = torch.arange(seq_len - q.shape[1], seq_len).unsqueeze(1)
        mask = torch.arange(seq_len).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE,
                                           enable_gqa=q.shape[0] != k.shape[0])
        out[qsl[i]:qsl[i + 1]] = o.transpose(0, 1)
    return out


# Half-precision prefill as chunked matmuls, as SDPA (AMX hosts) or through the native
# AVX512-BF16 kernel (bfloat16 only).
@pytest.mark.parametrize("prefill", ["matmul", "sdpa", "native"])
@pytest.mark.parametrize("bucket_cost", [None, 0])  # default split; one per block count
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 2), (4, 4)])
def test_torch_backend_matches_float32_sdpa(dtype: torch.dtype, num_heads: int,
                                            num_kv_heads: int, bucket_cost: int | None,
                                            prefill: str, decode_kernels: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if prefill != "matmul" and (dtype == torch.float32 or bucket_cost is not None):
        pytest.skip("float32 prefill is SDPA already; buckets are decode only")
    if prefill == "native" and (dtype != torch.bfloat16 or decode_kernels != "native"):
        pytest.skip("the native prefill takes bfloat16, beside the native decode")
    if prefill == "native" and not cpu.prefill_attention_supported():
        pytest.skip("the native prefill attention needs AVX512-BF16")
    if decode_kernels == "native" and bucket_cost is not None:
        pytest.skip("the native kernel has no buckets")
    if bucket_cost is not None:
        if dtype == torch.float32:
            pytest.skip("float32 decodes in one bucket")
        monkeypatch.setattr(torch_backend, "BUCKET_COST_POSITIONS", bucket_cost)
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    # One instance across steps and layers, as in the model; native decode where the kernel
    # choice would pick it (float32/bfloat16).
    backend = TorchAttentionBackend(
        native_decode=decode_kernels == "native" and dtype != torch.float16,
        sdpa_prefill=prefill == "sdpa", native_prefill=prefill == "native")
    for plan in PLANS:
        num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in plan) + 3
        meta, tables = attention_step(plan, BLOCK_SIZE, num_blocks, gen)
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        for _layer in range(2):
            k_cache = torch.randn(shape, generator=gen).to(dtype)
            v_cache = torch.randn(shape, generator=gen).to(dtype)
            num_tokens = meta.query_start_loc_cpu[-1]
            q, k, v = (torch.randn(num_tokens, h, HEAD_DIM, generator=gen).to(dtype)
                       for h in (num_heads, num_kv_heads, num_kv_heads))
            out = backend.forward(q, k, v, k_cache, v_cache, meta, SCALE)
            assert out.shape == q.shape and out.dtype == dtype
            atol, rtol = TOLERANCES[dtype]
            torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, meta, tables),
                                       atol=atol, rtol=rtol)


def test_split_by_length_keeps_every_row_once_and_pays_off() -> None:
    lens = (8, 600, 9, 610, 30, 7, 620, 5, 590, 12, 8, 615)
    rows = [r for r in range(len(lens)) if r != 4]  # row 4 is not a decode row
    groups = split_by_length(rows, lens, BLOCK_SIZE)
    assert sorted(r for g in groups for r in g) == rows
    assert all(g == sorted(g) for g in groups)
    assert len(groups) == 2 and {lens[r] for r in groups[0]} == {8, 9, 7, 5, 12}
    assert split_by_length([0, 1, 2], (40, 41, 47), BLOCK_SIZE) == [[0, 1, 2]]


def test_value_bags_index_with_int64_when_the_cache_is_large() -> None:
    gen = torch.Generator().manual_seed(0)
    meta, _ = attention_step([(40, 1), (7, 1)], BLOCK_SIZE, 8, gen)
    shape = (8, BLOCK_SIZE, 3, HEAD_DIM)
    small = build_decode_plan(meta, 9, torch.Size(shape), torch.bfloat16)
    large = build_decode_plan(meta, 9, torch.Size((2**26, *shape[1:])), torch.bfloat16)
    assert small is not None and isinstance(small.method, torch_backend._MatmulDecode)
    assert large is not None and isinstance(large.method, torch_backend._MatmulDecode)
    assert small.method.value_rows.dtype == torch.int32
    assert large.method.value_rows.dtype == torch.int64
    k_cache, v_cache = (torch.randn(shape, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(2, 9, HEAD_DIM, generator=gen).bfloat16()
    assert torch.equal(torch_backend._decode(q, k_cache, v_cache, small, SCALE),
                       torch_backend._decode(q, k_cache, v_cache, large, SCALE))
