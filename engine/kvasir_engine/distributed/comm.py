"""Collectives, the group always passed in (never `dist` globals).

Models never call these themselves (docs/architecture.md, rule 9): the parallel layers receive a `TPGroup`, whose
methods land here; at tp_size == 1 every call returns its input untouched. The point-to-point
and plain-data calls below serve the pipeline (worker/pipeline.py) and the ranks' step loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_reduce(tensor: torch.Tensor, size: int,
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the `size` ranks of `group`, in place; returns the same tensor."""
    if size == 1:
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, size: int, group: dist.ProcessGroup | None,
               dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, in rank order (same shape on all ranks)."""
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


def send(tensor: torch.Tensor, dst: int) -> dist.Work | None:
    """Start sending `tensor` to global rank `dst` (point to point, pipeline stages)."""
    return dist.isend(tensor.contiguous(), dst)


def recv(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Fill `tensor` from global rank `src`; returns it."""
    dist.recv(tensor, src)
    return tensor


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None) -> Any:
    """`obj` from global rank `src` on every rank of `group` (pickled; plain data only)."""
    if group is None:
        return obj
    items = [obj]
    dist.broadcast_object_list(items, src=src, group=group)
    return items[0]


def gather_objects(obj: Any, rank: int, dst: int, world_size: int,
                   group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on `dst` (None elsewhere); `rank` is the caller's."""
    if group is None:
        return [obj]
    items: list[Any] | None = [None] * world_size if rank == dst else None
    dist.gather_object(obj, items, dst=dst, group=group)
    return items


def all_reduce_ints(values: list[int], op: str, group: dist.ProcessGroup | None) -> list[int]:
    """Elementwise "min" or "sum" of a list of ints over every rank of a gloo `group`."""
    if group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM, group=group)
    return [int(v) for v in t.tolist()]
