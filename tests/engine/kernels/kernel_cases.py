"""Shared fixtures of the kernel tests: paged caches, tolerances, and the GPU-only wide grid."""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The wide grids run only when the kernels are compiled for a GPU (the interpreter is too slow).
REQUIRES_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_ONLY = (pytest.mark.gpu, REQUIRES_CUDA)

# (atol, rtol) against the float32 twin. bfloat16 keeps 8 mantissa bits (ulp 2^-8 near 1) and
# the kernels round the softmax weights to the input dtype before P @ V, as flash attention does.
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), atol=atol, rtol=rtol)


def random_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): every request's blocks are distinct, shuffled ids."""
    blocks_per_req = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    for r, n in enumerate(blocks_per_req):
        block_tables[r, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return k_cache, v_cache, block_tables


def to_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]
