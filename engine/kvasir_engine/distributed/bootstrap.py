"""The rendezvous every node of one engine passes before any of its ranks starts.

Node 0 hosts a torch `TCPStore` at --master-addr:--master-port (one node alone uses a free
loopback port); every node connects to it, publishes its configuration, and waits for all the
others within --rendezvous-timeout. So a start-up that cannot work fails fast, with one line on
every node:
- a node that never comes is named by its absence ("node rank 1 (ranks 2-3) did not join");
- a node started with other flags fails every node, each line naming the first field that
  differs and both values;
- a master that cannot be reached is named with its address.
The same store then carries the ranks' process-group rendezvous (`pg_store`), the first
failure of any rank (`report_failure`), so every node prints the cause rather than a peer's
broken socket, and every node's heartbeat (distributed/heartbeat.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any

# torch re-exports the c10d store classes without declaring them.
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from kvasir_engine.config import EngineConfig, ParallelConfig

__all__ = ["FAILURE_KEY", "Rendezvous", "Store", "TCPStore", "config_fields", "describe_node",
           "first_failure", "pg_store", "rendezvous", "report_failure"]

FAILURE_KEY = "kvasir/failure"
_CONFIG_KEY = "kvasir/config/{}"


@dataclass
class Rendezvous:
    """This node's connection to the store (node 0: the store itself) and where it lives."""

    host: str
    port: int
    store: TCPStore
    timeout_s: float

    def connect(self) -> TCPStore:
        """A new client connection (one per thread or process)."""
        return TCPStore(self.host, self.port, None, False, timedelta(seconds=self.timeout_s))


def config_fields(config: EngineConfig) -> dict[str, str]:
    """The configuration as flat `section.field: value` strings; the node's own rank and how
    long it waits are its own business."""
    own = replace(config.parallel, node_rank=0, rendezvous_timeout_s=1.0)
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            flat[prefix] = repr(value)

    walk("", asdict(replace(config, parallel=own)))
    return flat


def pg_store(store: Store) -> Store:
    """The view of the store torch.distributed's own rendezvous uses."""
    return PrefixStore("kvasir/pg", store)


def describe_node(parallel: ParallelConfig, node_rank: int) -> str:
    """`node rank 1 (ranks 2-3)`: a node named with the ranks it runs."""
    per_node = parallel.ranks_per_node
    first, last = node_rank * per_node, (node_rank + 1) * per_node - 1
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return f"node rank {node_rank} ({ranks})"


def rendezvous(config: EngineConfig) -> Rendezvous:
    """Meet every other node of `config`'s engine; ValueError (one line) when one cannot."""
    parallel = config.parallel
    timeout = timedelta(seconds=parallel.rendezvous_timeout_s)
    is_master = parallel.node_rank == 0
    host = parallel.master_addr if parallel.nnodes > 1 else "127.0.0.1"
    port = parallel.master_port if parallel.nnodes > 1 else 0
    try:
        store = TCPStore(host, port, None, is_master, timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        where = f"--master-addr {host} --master-port {port}"
        if is_master:
            raise ValueError(f"node rank 0 cannot host the rendezvous at {where}: "
                             f"{str(exc).splitlines()[0]}") from None
        raise ValueError(f"node rank {parallel.node_rank} cannot reach node rank 0 at {where} "
                         f"within {parallel.rendezvous_timeout_s:g}s") from None
    meeting = Rendezvous(host, int(store.port), store, parallel.rendezvous_timeout_s)
    mine = config_fields(config)
    store.set(_CONFIG_KEY.format(parallel.node_rank), json.dumps(mine))
    keys = [_CONFIG_KEY.format(n) for n in range(parallel.nnodes)]
    try:
        store.wait(keys, timeout)
    except RuntimeError:  # DistStoreError: a timeout
        missing = [n for n, key in enumerate(keys) if not _has(store, key)]
        names = ", ".join(describe_node(parallel, n) for n in missing)
        raise ValueError(f"{names} did not join the rendezvous at {host}:{meeting.port} within "
                         f"{parallel.rendezvous_timeout_s:g}s (--nnodes {parallel.nnodes})"
                         ) from None
    for node, key in enumerate(keys):
        theirs = json.loads(store.get(key))
        for name in sorted(mine.keys() | theirs.keys()):
            if mine.get(name) != theirs.get(name):
                raise ValueError(
                    f"node rank {node} was started with another configuration than node rank "
                    f"{parallel.node_rank}: {name} is {theirs.get(name)} there, "
                    f"{mine.get(name)} here (every node runs the same command)")
    return meeting


def _has(store: Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def report_failure(store: Store, message: str) -> str:
    """Record `message` as the group's failure unless one came first; returns the first."""
    first = store.compare_set(FAILURE_KEY, "", message)
    return first.decode() if isinstance(first, bytes) else str(first)


def first_failure(store: Store) -> str | None:
    """The group's first reported failure, if any; raises when the store is gone."""
    if not store.check([FAILURE_KEY]):
        return None
    value = store.get(FAILURE_KEY)
    return value.decode() if isinstance(value, bytes) else str(value)
