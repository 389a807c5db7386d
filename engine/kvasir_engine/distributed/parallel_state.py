"""Init and teardown of the tensor-parallel process group, and the `TPGroup` handle.

Each rank is its own process (spawned by `worker/tp_executor.py`), joins the group through a
TCP rendezvous on the loopback, and hands its `TPGroup` to the model runner, which passes it to
the parallel layers. NCCL on CUDA (one GPU per rank), gloo on CPU.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvasir_engine.distributed import comm

# How long a collective may wait for a peer before it raises. A dead peer is normally noticed
# much sooner (gloo sees the closed socket; the executor's watchdog sees the dead process).
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
        return comm.all_reduce(tensor, self)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return comm.all_gather(tensor, self, dim)


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def free_loopback_port() -> int:
    """A port the OS considers free now, for the rendezvous (rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_tp_group(tp_rank: int, tp_size: int, init_method: str, device: str) -> TPGroup:
    """Join the group of `tp_size` ranks at `init_method` (e.g. "tcp://127.0.0.1:PORT")."""
    backend = backend_for(device)
    if tp_size == 1:
        return TPGroup(tp_rank, tp_size, backend, None)
    if backend == "nccl":
        torch.cuda.set_device(tp_rank)
    dist.init_process_group(backend, init_method=init_method, rank=tp_rank, world_size=tp_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(tp_rank, tp_size, backend, dist.group.WORLD)


def destroy_tp_group(group: TPGroup) -> None:
    if group.process_group is not None and dist.is_initialized():
        dist.destroy_process_group()
