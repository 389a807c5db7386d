"""One rank's process: join the world, load this rank's part of the model, then run steps.

Global rank 0 (stage 0, tensor-parallel rank 0) is the driver: the engine process hands it each
step's plain `SchedulerOutput` down a pipe, it broadcasts the plan to every rank on every node
(docs/architecture.md, rule 6), and it answers with the step's `ModelRunnerOutput`. Every rank
runs the same plan through its `PipelineModelRunner` (worker/pipeline.py). A `None` plan is the
orderly shutdown: the ranks then gather their pipeline statistics on the driver and exit 0.

A rank that fails reports to its node's process (its pipe) and to the whole group (the
rendezvous store's first failure, distributed/bootstrap.py), then exits 1. During serving it
waits a moment before claiming to be the first: when a peer is killed, the survivors' broken
collectives are the symptom, and the peer's node reports the cause.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from kvasir_engine.config import EngineConfig, ParallelConfig, RuntimeInfo
from kvasir_engine.distributed import comm
from kvasir_engine.distributed.bootstrap import TCPStore, report_failure
from kvasir_engine.distributed.parallel_state import (
    RankGroups,
    destroy_rank_groups,
    init_rank_groups,
)
from kvasir_engine.kernels.host import cpu_threads

if TYPE_CHECKING:
    from kvasir_engine.worker.pipeline import PipelineModelRunner

# How long a rank that failed while serving waits before reporting itself as the cause.
PEER_DEATH_GRACE_S = 0.5
DRIVER_RANK = 0
# How often a rank checks that its node's process is still there.
PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class RankSpec:
    """What a node's process tells one of its rank processes."""

    rank: int  # global
    local_rank: int  # index on this node (its CUDA device)
    store_host: str
    store_port: int
    store_timeout_s: float
    cpu_ids: tuple[int, ...]


def describe_rank(parallel: ParallelConfig, rank: int) -> str:
    pp_rank, tp_rank = divmod(rank, parallel.tensor_parallel_size)
    where = f", node rank {rank // parallel.ranks_per_node}" if parallel.nnodes > 1 else ""
    return f"rank {rank} (stage {pp_rank}, tensor-parallel rank {tp_rank}{where})"


def cpu_ids(local_rank: int, num_local_ranks: int) -> tuple[int, ...]:
    """This rank's share of the node's cores, so the ranks' thread pools do not fight: of the
    cores the node process may use, as many as its thread budget (kernels/host.py
    `cpu_threads`: OMP_NUM_THREADS, or the cgroup's CPU quota), split between the ranks."""
    budget, _ = cpu_threads()
    cores = sorted(os.sched_getaffinity(0))[:budget]
    if len(cores) < num_local_ranks:
        return (cores[local_rank % len(cores)],)
    per_rank = len(cores) // num_local_ranks
    return tuple(cores[local_rank * per_rank:(local_rank + 1) * per_rank])


def _die_with_parent() -> None:
    """A rank outlives no node process, even one killed by SIGKILL: a thread watches for the
    parent to change. (PR_SET_PDEATHSIG would fire when the *thread* that spawned the rank
    ends, and the engine spawns its ranks from a loader thread.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvasir-parent-watch", daemon=True).start()


def run_rank(config: EngineConfig, spec: RankSpec, conn: Connection,
             kv_conn: Connection | None = None) -> None:
    """The process body (spawned with `multiprocessing`). `kv_conn`: a KV producer's pipe for
    the holds of this rank's block server (kv_transfer/tensor_parallel.py)."""
    from kvasir_engine.kv_transfer.tensor_parallel import RankKVTransfer
    from kvasir_engine.worker.pipeline import PipelineModelRunner

    _die_with_parent()
    parallel = config.parallel
    store: TCPStore | None = None
    groups: RankGroups | None = None
    serving = False
    try:
        if config.device.device != "cuda":
            os.sched_setaffinity(0, spec.cpu_ids)
        store = TCPStore(spec.store_host, spec.store_port, None, False,
                              timedelta(seconds=spec.store_timeout_s))
        groups = init_rank_groups(spec.rank, parallel.tensor_parallel_size,
                                  parallel.pipeline_parallel_size, store, config.device.device,
                                  spec.local_rank)
        kv_transfer = (RankKVTransfer(config, groups.tp.tp_rank, conn, kv_conn)
                       if config.kv_transfer is not None else None)
        runner = PipelineModelRunner(config, groups, spec.local_rank, kv_transfer)
        info = _agree(runner.initialize_kv_cache(), groups)
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        conn.send(("ready", (info, weight_bytes)))
        serving = True
        _serve(runner, groups, conn if spec.rank == DRIVER_RANK else None)
        stats = comm.gather_objects(runner.stats, spec.rank, DRIVER_RANK, groups.world_size,
                                    groups.control)
        if spec.rank == DRIVER_RANK:
            conn.send(("stats", stats))
    except EOFError:  # the node's process is gone
        sys.exit(1)
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the rank exits
        message = f"{describe_rank(parallel, spec.rank)}: {type(e).__name__}: {e}"
        message = message.splitlines()[0]
        try:
            conn.send(("error", (type(e).__name__, message)))
            if serving:
                time.sleep(PEER_DEATH_GRACE_S)
            if store is not None:
                report_failure(store, message)
        except Exception:  # noqa: BLE001 - the node or the store is gone too: exit all the same
            pass
        finally:
            sys.exit(1)
    finally:
        if groups is not None:
            destroy_rank_groups(groups)


def _agree(info: RuntimeInfo, groups: RankGroups) -> RuntimeInfo:
    """The KV facts of the whole group: block ids below the smallest count are valid on every
    rank; a block's bytes are the sum of every rank's share."""
    per_block = info.kv_cache_bytes // max(1, info.num_kv_blocks)
    (num_blocks,) = comm.all_reduce_ints([info.num_kv_blocks], "min", groups.control)
    (block_bytes,) = comm.all_reduce_ints([per_block], "sum", groups.control)
    return replace(info, num_kv_blocks=num_blocks, kv_cache_bytes=block_bytes * num_blocks)


def _serve(runner: PipelineModelRunner, groups: RankGroups, conn: Connection | None) -> None:
    while True:
        plan = None
        if conn is not None:  # the driver
            kind, payload = conn.recv()
            plan = payload if kind == "execute" else None
        plan = comm.broadcast_object(plan, DRIVER_RANK, groups.control)
        if plan is None:
            return
        output = runner.execute_model(plan)
        if conn is not None:
            conn.send(("output", output))
