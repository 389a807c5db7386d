"""Init and teardown of one rank's process groups, and the handles passed down from them.

Every rank is its own process (spawned by `worker/multiproc_executor.py` on the leader node and
by `worker/worker_node.py` on the others) and joins one torch.distributed world of
`tensor_parallel_size x pipeline_parallel_size` ranks through the rendezvous store
(distributed/bootstrap.py). Global rank = stage x tp_size + tp rank, so a stage's tensor-parallel
ranks are consecutive (and on one node). NCCL on CUDA, gloo on CPU; plain data (plans, sampled
tokens) always travels on a gloo group, whatever the device.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvasir_engine.distributed import comm
from kvasir_engine.distributed.bootstrap import Store, pg_store

# How long a collective may wait for a peer before it raises. A dead peer is normally noticed
# much sooner (gloo sees the closed socket; the node's watchdog sees the dead process).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TPGroup:
    """This rank's view of its tensor-parallel group (implements layers.parallel's protocol)."""

    tp_rank: int
    tp_size: int
    backend: str  # "nccl" or "gloo"
    process_group: dist.ProcessGroup | None  # None at tp_size == 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(tensor, self.tp_size, self.process_group)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return comm.all_gather(tensor, self.tp_size, self.process_group, dim)


@dataclass(frozen=True)
class RankGroups:
    """Everything a rank knows of the world it joined."""

    rank: int  # global
    tp: TPGroup
    pp_rank: int
    pp_size: int
    # gloo over every rank, for plain data (None when the world is one rank).
    control: dist.ProcessGroup | None

    @property
    def world_size(self) -> int:
        return self.tp.tp_size * self.pp_size

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of this rank's tensor-parallel peer in stage `pp_rank`."""
        return pp_rank * self.tp.tp_size + self.tp.tp_rank

    @property
    def last_stage_leader(self) -> int:
        """The global rank that answers a step: the last stage's tensor-parallel rank 0."""
        return (self.pp_size - 1) * self.tp.tp_size


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def free_loopback_port() -> int:
    """A port the OS considers free now (for a server bound moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank_groups(rank: int, tp_size: int, pp_size: int, store: Store | None,
                     device: str, local_rank: int) -> RankGroups:
    """Join the world of tp_size x pp_size ranks through `store` (None for a world of one)."""
    backend = backend_for(device)
    world_size = tp_size * pp_size
    pp_rank, tp_rank = divmod(rank, tp_size)
    if world_size == 1:
        return RankGroups(rank, TPGroup(0, 1, backend, None), 0, 1, None)
    if store is None:
        raise ValueError("a world of several ranks needs a rendezvous store")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, store=pg_store(store), rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    # Every rank creates every group, in the same order (torch.distributed's rule).
    tp_groups = [dist.new_group(list(range(p * tp_size, (p + 1) * tp_size)))
                 for p in range(pp_size)] if pp_size > 1 and tp_size > 1 else []
    tp_pg = None if tp_size == 1 else dist.group.WORLD if pp_size == 1 else tp_groups[pp_rank]
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return RankGroups(rank, TPGroup(tp_rank, tp_size, backend, tp_pg), pp_rank, pp_size, control)


def destroy_rank_groups(groups: RankGroups) -> None:
    if groups.control is not None and dist.is_initialized():
        dist.destroy_process_group()
