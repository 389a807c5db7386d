"""Argument checks shared by the kernel launchers: a clear ValueError naming the argument.

A Triton kernel handed a wrong shape or stride reads garbage or faults far from the cause, so
every launcher checks what it is given before it launches.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> None:
    """`shape` entries of None accept any size; `device`, when given, must match."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape, strict=True)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Both caches [num_blocks, block_size, num_kv_heads, head_dim], same shape/dtype, contiguous."""
    check_tensor("k_cache", k_cache, (None, None, None, None), FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, tuple(k_cache.shape), (k_cache.dtype,), k_cache.device)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
