"""Collectives over a tensor-parallel group, the group always passed in (never `dist` globals).

Models never call these themselves (docs/architecture.md, rule 9): the parallel layers receive a `TPGroup`, whose
methods land here. At tp_size == 1 every call returns its input untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from kvasir_engine.distributed.parallel_state import TPGroup


def all_reduce(tensor: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sum over ranks, in place; returns the same tensor."""
    if group.tp_size == 1:
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group.process_group)
    return tensor


def all_gather(tensor: torch.Tensor, group: TPGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, in rank order (same shape on all ranks)."""
    if group.tp_size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(group.tp_size)]
    dist.all_gather(parts, tensor, group=group.process_group)
    return torch.cat(parts, dim=dim)


def all_reduce_min(value: int, group: TPGroup) -> int:
    """The smallest of an int over ranks (e.g. KV blocks that fit on every rank)."""
    if group.tp_size == 1:
        return value
    device = "cuda" if group.backend == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.process_group)
    return int(t.item())


def barrier(group: TPGroup) -> None:
    if group.tp_size > 1:
        dist.barrier(group=group.process_group)
