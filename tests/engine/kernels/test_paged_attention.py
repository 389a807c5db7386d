"""Decode paged attention (split-K + merge) against its twin, under the interpreter on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, GPU_ONLY, assert_close, random_paged_kv, to_device
from kvasir_engine.kernels import reference as ref
from kvasir_engine.kernels.paged_attention import paged_decode_attention

# Odd lengths, lengths ending mid-block and on a block edge, a one-token context, and a padding
# slot (seq_len 0, what a CUDA-graph batch pads with).
SEQ_LENS = [1, 37, 64, 83, 0]

# (head_dim, gqa ratio, block_size, dtype): every value of each axis at least once.
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
             partition_size: int, seq_lens: list[int], num_kv_heads: int = 2) -> None:
    gen = torch.Generator().manual_seed(head_dim + group * 7 + block_size + partition_size)
    k_cache, v_cache, block_tables = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size,
                                                     dtype, gen)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = ref.paged_decode_attention(query, k_cache, v_cache, block_tables, lens, scale)
    q, kc, vc, bt, sl = to_device(query, k_cache, v_cache, block_tables, lens)
    out = paged_decode_attention(q, kc, vc, bt, sl, scale, max_seq_len=max(seq_lens),
                                 partition_size=partition_size)
    assert_close(out, expected)


@pytest.mark.parametrize(("head_dim", "group", "block_size", "dtype"), CASES)
@pytest.mark.parametrize("partition_size", [32, 512])  # 32 splits every context; 512 does not
def test_decode_matches_twin(head_dim: int, group: int, block_size: int, dtype: torch.dtype,
                             partition_size: int) -> None:
    run_case(head_dim, group, block_size, dtype, partition_size, SEQ_LENS)


@pytest.mark.parametrize(("head_dim", "group", "block_size", "dtype"), WIDE)
@pytest.mark.parametrize("partition_size", [64, 512])
def test_decode_matches_twin_wide(head_dim: int, group: int, block_size: int, dtype: torch.dtype,
                                  partition_size: int) -> None:
    run_case(head_dim, group, block_size, dtype, partition_size,
             [1, 15, 17, 300, 1023, 2049, 0, 4096], num_kv_heads=8 // group)


def test_graph_style_bound_with_more_partitions_than_context() -> None:
    """A captured graph launches with max_seq_len = max_model_len; empty partitions must weigh nothing."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, block_tables = random_paged_kv([3, 20], 1, 64, 16, torch.float32, gen,
                                                     spare_blocks=0)
    block_tables = torch.cat([block_tables, torch.zeros(2, 6, dtype=torch.int32)], dim=1)
    query = torch.randn(2, 4, 64, generator=gen)
    lens = torch.tensor([3, 20], dtype=torch.int32)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, block_tables, lens, 0.125)
    q, kc, vc, bt, sl = to_device(query, k_cache, v_cache, block_tables, lens)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kc, vc, bt, sl, 0.125, max_seq_len=128, partition_size=32, out=out)
    assert_close(out, expected)


def test_launcher_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables = to_device(*random_paged_kv([5], 2, 64, 16, torch.float32, gen))
    query = torch.randn(1, 4, 64, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="query"):
        paged_decode_attention(query[..., :32], k_cache, v_cache, block_tables, lens, 1.0,
                               max_seq_len=5)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(query[:, :3], k_cache, v_cache, block_tables, lens, 1.0,
                               max_seq_len=5)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(query, k_cache, v_cache, block_tables, lens.float(), 1.0,
                               max_seq_len=5)
    with pytest.raises(ValueError, match="v_cache"):
        paged_decode_attention(query, k_cache, v_cache.half(), block_tables, lens, 1.0,
                               max_seq_len=5)
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_decode_attention(query, k_cache, v_cache, block_tables, lens, 1.0, max_seq_len=999)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode_attention(query, k_cache, v_cache, block_tables, lens, 1.0, max_seq_len=5,
                               partition_size=48)
