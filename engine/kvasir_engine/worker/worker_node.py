"""`run_worker_node`: what `kvasir-engine serve --node-rank R` (R > 0) runs instead of a server.

A worker node meets the others at the leader's rendezvous store (distributed/bootstrap.py),
spawns its `world_size / nnodes` ranks (worker/local_ranks.py), and then only watches: its ranks
take their plans from the driver over torch.distributed. It opens no port and exposes nothing.
It exits 0 after an orderly shutdown (every rank exited 0: the leader said so) and 1 as soon as
the group breaks: a local rank dies or errs, another node reports a failure or goes silent, or
the leader goes away (its store closed, or no heartbeat from it for --node-heartbeat-timeout:
distributed/heartbeat.py), even while its ranks still load; each time with one line naming
the cause.
"""

from __future__ import annotations

import logging
import sys
import time
from multiprocessing.connection import wait

from kvasir_engine.config import EngineConfig
from kvasir_engine.distributed.bootstrap import rendezvous
from kvasir_engine.worker.local_ranks import WATCH_INTERVAL_S, LocalRanks, RankFailure
from kvasir_engine.worker.multiproc_executor import START_TIMEOUT_S, check_tp_fits

logger = logging.getLogger(__name__)

# After the leader's store went away, how long the ranks have to exit 0 (an orderly shutdown
# closes the store moments after the ranks were told to stop).
ORDERLY_EXIT_GRACE_S = 5.0


def run_worker_node(config: EngineConfig) -> int:
    """Serve this node's ranks until the group ends; the exit code. ValueError (one line) for
    a start-up that cannot work."""
    check_tp_fits(config)
    parallel = config.parallel
    local = LocalRanks(config, rendezvous(config))
    local.start()
    try:
        try:
            for local_rank in range(len(local.ranks)):
                local.receive(local_rank, "ready", START_TIMEOUT_S)
        except RankFailure as e:  # a start-up that cannot work: one line, exit 2
            raise ValueError(str(e)) from None
        except RuntimeError as e:  # remote_failure: the leader went away
            return _leader_gone(local, str(e))
        logger.info("node rank %d: ranks %d-%d ready", parallel.node_rank, local.ranks[0],
                    local.ranks[-1])
        return _watch(local)
    finally:
        local.kill()
        local.close()


def _watch(local: LocalRanks) -> int:
    while True:
        ready = wait([*local.conns, *local.sentinels], WATCH_INTERVAL_S)
        for conn in local.conns:
            if conn in ready and conn.poll():
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    continue
                if kind == "error":
                    return _fail(local, local.group_failure(payload[1], wait_s=1.0))
        exited = [p.exitcode for p in local.procs if not p.is_alive()]
        if any(code != 0 for code in exited):
            dead = next(r for r, p in enumerate(local.procs)
                        if not p.is_alive() and p.exitcode != 0)
            return _fail(local, local.group_failure(local.death_message(dead)))
        if len(exited) == len(local.procs):
            logger.info("every rank exited after the leader's shutdown")
            return 0
        try:
            remote = local.remote_failure()
        except RuntimeError as e:
            return _leader_gone(local, str(e))
        if remote is not None:
            return _fail(local, remote)


def _leader_gone(local: LocalRanks, reason: str) -> int:
    deadline = time.monotonic() + ORDERLY_EXIT_GRACE_S
    for proc in local.procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    if all(p.exitcode == 0 for p in local.procs):
        return 0
    parallel = local.config.parallel
    return _fail(local, f"the leader (node rank 0 at {parallel.master_addr}:"
                        f"{parallel.master_port}) went away: {reason}")


def _fail(local: LocalRanks, message: str) -> int:
    local.kill()  # first: the heartbeat's last store errors go before the one-line verdict
    print(f"kvasir-engine: error: {message}", file=sys.stderr, flush=True)
    return 1
