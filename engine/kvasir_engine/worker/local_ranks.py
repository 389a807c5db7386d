"""`LocalRanks`: the rank processes one node runs, and what their deaths and errors mean.

Both the leader's executor (worker/multiproc_executor.py) and a worker node
(worker/worker_node.py) spawn their node's ranks through this class, wait on their pipes and
their process sentinels (a node's process never joins a collective, so it cannot hang in one),
and name a failure the same way. The group's first failure, whichever node saw it, is read back
from the rendezvous store, so every node reports the cause.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

from kvasir_engine.config import EngineConfig
from kvasir_engine.distributed.bootstrap import Rendezvous, first_failure, report_failure
from kvasir_engine.worker.rank import RankSpec, cpu_ids, describe_rank, run_rank

# How long a node's process waits, once a rank erred, for the group's first failure (a peer's
# death, reported by its own node) to appear before it names the local error as the cause.
FAILURE_GRACE_S = 1.0


class RankFailure(RuntimeError):
    """A rank died or erred; `error_type` is the rank's exception type ("" for a death)."""

    def __init__(self, message: str, error_type: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type


class LocalRanks:
    def __init__(self, config: EngineConfig, meeting: Rendezvous) -> None:
        self.config = config
        self.meeting = meeting
        self.ranks = list(config.parallel.node_ranks)
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        # Messages read while waiting for another rank's, kept for their own `receive`.
        self._pending: dict[int, list[tuple[str, Any]]] = {}

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        for local_rank, rank in enumerate(self.ranks):
            spec = RankSpec(rank, local_rank, self.meeting.host, self.meeting.port,
                            self.meeting.timeout_s, cpu_ids(local_rank, len(self.ranks)))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_rank, name=f"kvasir-rank-{rank}", daemon=True,
                               args=(self.config, spec, child))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

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
        while True:
            ready = wait([*self.conns, *self.sentinels], timeout)
            if not ready:
                raise RankFailure(self.group_failure(
                    f"{describe_rank(self.config.parallel, self.ranks[local_rank])} sent no "
                    f"{expected!r} within {timeout}s"))
            for r, conn in enumerate(self.conns):  # messages first: an error explains a death
                if conn in ready:
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        continue
                    if kind == "error":
                        error_type, message = payload
                        cause = self.group_failure(message, wait_s=FAILURE_GRACE_S)
                        raise RankFailure(cause, error_type if cause == message else "")
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
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5.0)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
