"""Ragged prefill attention over cached prefixes against its twin, under the interpreter on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, GPU_ONLY, assert_close, random_paged_kv, to_device
from kvasir_engine.kernels import reference as ref
from kvasir_engine.kernels.prefill_attention import paged_prefill_attention

# (cached prefix, chunk length): empty prefix with an odd chunk, a prefix and a chunk that end
# mid-block, a one-token decode riding along, a chunk longer than one query tile.
PLAN = [(0, 5), (37, 19), (16, 1), (0, 41)]
CASES = [
    (64, 1, 16, torch.float32),
    (128, 4, 32, torch.bfloat16),
    (64, 8, 32, torch.float16),
    (128, 8, 16, torch.float32),
    (64, 4, 16, torch.bfloat16),
    (128, 1, 32, torch.float16),
]
WIDE = [pytest.param(*c, marks=GPU_ONLY)
        for c in itertools.product((64, 128), (1, 4, 8), (16, 32), DTYPES)]


def run_case(head_dim: int, group: int, block_size: int, dtype: torch.dtype,
             plan: list[tuple[int, int]], num_kv_heads: int = 1, block_m: int = 32,
             block_n: int = 32) -> None:
    gen = torch.Generator().manual_seed(head_dim + group * 7 + block_size)
    seq_lens = [p + c for p, c in plan]
    k_cache, v_cache, block_tables = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size,
                                                     dtype, gen)
    chunks = [c for _, c in plan]
    query = torch.randn(sum(chunks), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = ref.paged_prefill_attention(query, k_cache, v_cache, block_tables, starts, lens,
                                           scale)
    q, kc, vc, bt, qsl, sl = to_device(query, k_cache, v_cache, block_tables, starts, lens)
    out = paged_prefill_attention(q, kc, vc, bt, qsl, sl, scale, max_query_len=max(chunks),
                                  block_m=block_m, block_n=block_n)
    assert_close(out, expected)


@pytest.mark.parametrize(("head_dim", "group", "block_size", "dtype"), CASES)
def test_prefill_matches_twin(head_dim: int, group: int, block_size: int,
                              dtype: torch.dtype) -> None:
    run_case(head_dim, group, block_size, dtype, PLAN)


def test_prefill_tiles_smaller_than_a_block() -> None:
    run_case(64, 2, 32, torch.float32, [(21, 40), (0, 17)], block_m=16, block_n=16)


@pytest.mark.parametrize(("head_dim", "group", "block_size", "dtype"), WIDE)
def test_prefill_matches_twin_wide(head_dim: int, group: int, block_size: int,
                                   dtype: torch.dtype) -> None:
    plan = [(0, 1), (0, 300), (511, 257), (1000, 1), (33, 64), (4000, 129)]
    run_case(head_dim, group, block_size, dtype, plan, num_kv_heads=8 // group, block_m=64,
             block_n=64)


def test_launcher_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables = to_device(*random_paged_kv([5], 2, 64, 16, torch.float32, gen))
    query = torch.randn(5, 4, 64, device=DEVICE)
    starts = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(query, k_cache, v_cache, block_tables, starts[:1], lens, 1.0,
                                max_query_len=5)
    with pytest.raises(ValueError, match="query"):
        paged_prefill_attention(query.half(), k_cache, v_cache, block_tables, starts, lens, 1.0,
                                max_query_len=5)
    with pytest.raises(ValueError, match="block_m"):
        paged_prefill_attention(query, k_cache, v_cache, block_tables, starts, lens, 1.0,
                                max_query_len=5, block_m=24)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill_attention(query[..., :48], k_cache[..., :48].contiguous(),
                                v_cache[..., :48].contiguous(), block_tables, starts, lens, 1.0,
                                max_query_len=5)
