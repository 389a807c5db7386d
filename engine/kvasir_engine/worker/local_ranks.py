"""`LocalRanks`: the rank processes one node runs, and what their deaths and errors mean.

Both the leader's executor (worker/multiproc_executor.py) and a worker node
(worker/worker_node.py) spawn their node's ranks through this class, wait on their pipes and
their process sentinels (a node's process never joins a collective, so it cannot hang in one),
and name a failure the same way. The group's first failure, whichever node saw it, is read back
from the rendezvous store, so every node reports the cause. With several nodes each also beats
in that store and watches the others' beats (distributed/heartbeat.py): a node that vanished
whole, which no pipe or sentinel here would show, is a failure too.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

from kvasir_engine.config import EngineConfig
from kvasir_engine.distributed.bootstrap import (
    Rendezvous,
    describe_node,
    first_failure,
    report_failure,
)
from kvasir_engine.distributed.heartbeat import LEADER_NODE, Heartbeat
from kvasir_engine.worker.rank import RankSpec, cpu_ids, describe_rank, run_rank

# How long a node's process waits, once a rank erred, for the group's first failure (a peer's
# death, reported by its own node) to appear before it names the local error as the cause.
FAILURE_GRACE_S = 1.0
# How often a wait on the local ranks also looks for a failure another node reported.
WATCH_INTERVAL_S = 0.25


class RankFailure(RuntimeError):
    """A rank died or erred, here or on another node; the message names it."""


class LocalRanks:
    def __init__(self, config: EngineConfig, meeting: Rendezvous) -> None:
        self.config = config
        self.meeting = meeting
        self.ranks = list(config.parallel.node_ranks)
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        # A KV producer's: the holds to each rank's block server (kv_transfer/tensor_parallel.py).
        self.kv_conns: list[Connection] = []
        # Messages read while waiting for another rank's, kept for their own `receive`.
        self._pending: dict[int, list[tuple[str, Any]]] = {}
        self.heartbeat = (Heartbeat(meeting, config.parallel) if config.parallel.nnodes > 1
                          else None)

    def start(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.start()
        ctx = mp.get_context("spawn")
        for local_rank, rank in enumerate(self.ranks):
            spec = RankSpec(rank, local_rank, self.meeting.host, self.meeting.port,
                            self.meeting.timeout_s, cpu_ids(local_rank, len(self.ranks)))
            parent, child = ctx.Pipe()
            kv_parent, kv_child = ctx.Pipe() if self._is_kv_producer else (None, None)
            proc = ctx.Process(target=run_rank, name=f"kvasir-rank-{rank}", daemon=True,
                               args=(self.config, spec, child, kv_child))
            proc.start()
            child.close()
            if kv_parent is not None and kv_child is not None:
                kv_child.close()
                self.kv_conns.append(kv_parent)
            self.procs.append(proc)
            self.conns.append(parent)

    @property
    def _is_kv_producer(self) -> bool:
        return self.config.kv_transfer is not None and self.config.kv_transfer.is_producer

    @property
    def sentinels(self) -> list[Any]:
        return [p.sentinel for p in self.procs]

    def receive(self, local_rank: int, expected: str, timeout: float | None) -> Any:
        """Local rank `local_rank`'s next `expected` message; RankFailure when any local rank
        errs or dies first, or nothing comes within `timeout`."""
        pending = self._pending.setdefault(local_rank, [])
        if pending:
            kind, payload = pending.pop(0)
            if kind == expected:
                return payload
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WATCH_INTERVAL_S if deadline is None else min(
                WATCH_INTERVAL_S, max(0.0, deadline - time.monotonic()))
            ready = wait([*self.conns, *self.sentinels], left)
            if not ready:
                remote = self.remote_failure()
                if remote is not None:
                    raise RankFailure(remote)
                if deadline is not None and time.monotonic() >= deadline:
                    raise RankFailure(self.group_failure(
                        f"{describe_rank(self.config.parallel, self.ranks[local_rank])} sent "
                        f"no {expected!r} within {timeout}s"))
                continue
            for r, conn in enumerate(self.conns):  # messages first: an error explains a death
                if conn in ready:
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        continue
                    if kind == "error":
                        _, message = payload
                        raise RankFailure(self.group_failure(message, wait_s=FAILURE_GRACE_S))
                    if r == local_rank and kind == expected:
                        return payload
                    self._pending.setdefault(r, []).append((kind, payload))
            for r, proc in enumerate(self.procs):
                if proc.sentinel in ready:
                    raise RankFailure(self.group_failure(self.death_message(r)))

    def death_message(self, local_rank: int) -> str:
        proc = self.procs[local_rank]
        proc.join(timeout=1.0)
        return (f"{describe_rank(self.config.parallel, self.ranks[local_rank])} (pid {proc.pid})"
                f" died with exit code {proc.exitcode}; the engine cannot continue")

    def remote_failure(self) -> str | None:
        """A failure another node reported, or a node gone silent, as the heartbeat last saw
        them (None on one node, where the pipes say it all). Raises RuntimeError, with the
        reason, when the leader's store is gone or the leader silent."""
        beat = self.heartbeat
        if beat is None:
            return None
        if beat.failure is not None:
            return beat.failure
        if beat.store_error is not None:
            raise RuntimeError(f"its store connection broke ({beat.store_error})")
        silent = beat.silent_node()
        if silent is None:
            return None
        quiet = f"sent no heartbeat for {beat.timeout_s:g}s (--node-heartbeat-timeout)"
        if silent == LEADER_NODE:
            raise RuntimeError(f"it {quiet}")
        return self.group_failure(f"{describe_node(self.config.parallel, silent)} {quiet}: the "
                                  f"node is gone; the engine cannot continue")

    def group_failure(self, message: str, wait_s: float = 0.0) -> str:
        """The group's first failure: one another node (or rank) reported within `wait_s`,
        else `message`, now recorded as the first. The store's own node answers for it when
        the store is gone."""
        deadline = time.monotonic() + wait_s
        try:
            store = self.meeting.store
            while True:
                first = first_failure(store)
                if first is not None:
                    return first
                if time.monotonic() >= deadline:
                    return report_failure(store, message)
                time.sleep(0.05)
        except RuntimeError:
            return message

    def kill(self) -> None:
        """The ranks, and the heartbeat: a node that gave up is silent from here on."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5.0)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()  # after an orderly shutdown, the only stop
        for conn in [*self.conns, *self.kv_conns]:
            conn.close()
