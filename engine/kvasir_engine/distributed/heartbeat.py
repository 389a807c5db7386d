"""`Heartbeat`: each node's sign of life in the rendezvous store, and the silence of the others.

A rank that dies alone is noticed at once: its node's process waits on its sentinel and reports
it (worker/local_ranks.py). A node that vanishes whole (its pod's processes killed together, its
host powered off or cut from the network) reports nothing, and an idle engine waits on nothing
that node held: the leader's ranks sit on their pipe, its watchdog on their sentinels. So every
node's process runs one daemon thread that, every HEARTBEAT_INTERVAL_S, adds one to its own
counter in the leader's store and reads the counters of the nodes it watches (the leader: every
worker node; a worker node: the leader), and with them the group's first failure
(distributed/bootstrap.py). A counter that stands still for --node-heartbeat-timeout seconds,
measured on this node's own clock (no two clocks are compared), makes its node silent.

The thread has its own store connection, and it is the only reader of the store while the
engine serves: a TCPStore client waits without bound on a server that stopped answering without
closing its socket (its host gone, its process frozen), whatever the store's timeout. So a
worker node also counts the leader silent when the thread's last exchange is older than the
timeout, and the watch loops only ever read what the thread last saw.
"""

from __future__ import annotations

import threading
import time

from kvasir_engine.config import ParallelConfig
from kvasir_engine.distributed.bootstrap import Rendezvous, first_failure

__all__ = ["HEARTBEAT_INTERVAL_S", "LEADER_NODE", "Heartbeat"]

# How often a node beats (and reads the others' beats and the group's failure): as often as the
# watch loops look, so a failure reported in the store reaches them no later than before.
HEARTBEAT_INTERVAL_S = 0.25
LEADER_NODE = 0
_BEAT_KEY = "kvasir/heartbeat/{}"


class Heartbeat:
    def __init__(self, meeting: Rendezvous, parallel: ParallelConfig) -> None:
        self.meeting = meeting
        self.node_rank = parallel.node_rank
        self.timeout_s = parallel.node_heartbeat_timeout_s
        self.watched = ([n for n in range(1, parallel.nnodes)] if self.node_rank == LEADER_NODE
                        else [LEADER_NODE])
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Written by the thread under the lock, read by the watch loops.
        self._last_exchange = time.monotonic()
        self._silent: int | None = None
        self._failure: str | None = None
        self._store_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvasir-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._thread.is_alive():
            # Not longer: the thread may be stuck on a store that stopped answering.
            self._thread.join(timeout=2 * HEARTBEAT_INTERVAL_S)

    @property
    def failure(self) -> str | None:
        """The group's first failure, as last read."""
        with self._lock:
            return self._failure

    @property
    def store_error(self) -> str | None:
        """Why the store connection broke (its host's process is gone), once it has."""
        with self._lock:
            return self._store_error

    def silent_node(self) -> int | None:
        """A watched node whose counter stood still for longer than the timeout; on a worker
        node also the leader when the store has not answered for that long."""
        with self._lock:
            silent, last_exchange = self._silent, self._last_exchange
        if (silent is None and self.node_rank != LEADER_NODE
                and time.monotonic() - last_exchange > self.timeout_s):
            return LEADER_NODE
        return silent

    def _run(self) -> None:
        own = _BEAT_KEY.format(self.node_rank)
        counts = dict.fromkeys(self.watched, 0)  # 0: not beaten yet
        heard = dict.fromkeys(self.watched, time.monotonic())
        try:
            store = self.meeting.connect()
            while not self._stopping.is_set():
                store.add(own, 1)
                # add(key, 0) reads a counter, and needs no key to exist yet.
                seen = {n: store.add(_BEAT_KEY.format(n), 0) for n in self.watched}
                failure = first_failure(store)
                now = time.monotonic()
                for node, count in seen.items():
                    if count != counts[node]:
                        counts[node], heard[node] = count, now
                silent = next((n for n in self.watched if now - heard[n] > self.timeout_s),
                              None)
                with self._lock:
                    self._last_exchange, self._failure = now, failure
                    if self._silent is None:
                        self._silent = silent
                self._stopping.wait(HEARTBEAT_INTERVAL_S)
        except Exception as e:  # noqa: BLE001 - a broken connection does not mend: record, end
            lines = str(e).strip().splitlines()
            with self._lock:
                self._store_error = f"{type(e).__name__}: {lines[0] if lines else ''}"
