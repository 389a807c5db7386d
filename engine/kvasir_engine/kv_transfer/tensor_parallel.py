"""Disaggregated prefill and decode under tensor parallelism: each rank moves its own shard.

A rank's KV cache holds only its KV heads, in its own process, and the engine process (the
scheduler's, the HTTP server's) holds no KV tensor at all. So:

- Producer: every rank runs its own `BlockServer` (producer.py) over its own tensors, on
  `kv_port + tp_rank` (`RankKVTransfer`); `kv_transfer_params` advertise rank 0's port and
  `tp_size`. The engine process still decides the holds: `RankServers` hands each one to every
  rank down a pipe of its own (one per rank, made by worker/local_ranks.py), waits until every
  rank has it (a consumer must never ask a rank before it knows the transfer), and frees the
  blocks once every rank is done with its part: sent, failed, refused, or expired after
  hold_timeout_s, each rank on its own. A transfer counts as sent when every rank sent its part.
- Consumer: the engine process fetches every rank's shard on its event loop, before the request
  is admitted, as with one process (consumer.py `fetch_shards`: one stream per producer rank,
  each checked alone). The executor then sends each rank its own shard down that rank's step
  pipe, right after the step's plan (worker/multiproc_executor.py), and the rank writes it into
  the request's blocks before its forward pass (`RankKVTransfer.load`). A rank's bytes cross the
  engine process once, never another rank's process.

Messages on a rank's KV pipe, plain tuples:
  engine -> rank: ("hold", (transfer_id, block_ids, block_hashes, token_ids))
  rank -> engine: ("held", transfer_id), ("sent", SentTransfer), ("released", [transfer_id, ...])
On a rank's step pipe, after ("execute", plan), one ("kv_blocks", [payload, ...] | None) per
new request of the plan whose `KVLoad` has blocks (None: they were gone; nothing is written and
the executor fails that request).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from kvasir_engine.config import EngineConfig, KVTransferConfig
from kvasir_engine.core.outputs import KVLoad
from kvasir_engine.kv_transfer import wire
from kvasir_engine.kv_transfer.blocks import KVCaches, block_nbytes, read_block, write_block
from kvasir_engine.kv_transfer.producer import BlockServer, SentTransfer, open_block_server

logger = logging.getLogger(__name__)

# How long a hold waits for every rank to know it; only a hung rank takes this long.
HOLD_ACK_TIMEOUT_S = 10.0
# How often the engine's reader of the ranks' pipes looks whether it should stop.
READ_INTERVAL_S = 0.5


@dataclass
class _Transfer:
    num_held: int = 0  # ranks that know it
    num_released: int = 0  # ranks done with it
    sent: list[SentTransfer] = field(default_factory=list)


class RankServers:
    """The engine process's view of the ranks' block servers, as `KVConnector.server`: `hold`
    and `num_held` as a `BlockServer` has them."""

    def __init__(self, conns: Sequence[Connection], port: int,
                 release: Callable[[list[str]], None],
                 on_sent: Callable[[SentTransfer], None]) -> None:
        self.port = port  # rank 0's; rank r's is port + r
        self._conns = list(conns)
        self._release = release
        self._on_sent = on_sent
        self._cond = threading.Condition()
        self._transfers: dict[str, _Transfer] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._read, name="kvasir-kv-ranks", daemon=True)
        self._thread.start()

    @property
    def num_held(self) -> int:
        """Transfers some rank still holds."""
        with self._cond:
            return len(self._transfers)

    def hold(self, transfer_id: str, block_ids: list[int], block_hashes: list[bytes],
             token_ids: list[int]) -> None:
        transfer = _Transfer()
        with self._cond:
            self._transfers[transfer_id] = transfer
        for conn in self._conns:
            conn.send(("hold", (transfer_id, block_ids, block_hashes, token_ids)))
        with self._cond:
            if not self._cond.wait_for(lambda: transfer.num_held == len(self._conns)
                                       or self._stopping, HOLD_ACK_TIMEOUT_S):
                logger.warning("KV transfer %s: not every rank acknowledged its hold within "
                               "%gs", transfer_id, HOLD_ACK_TIMEOUT_S)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _read(self) -> None:
        conns = list(self._conns)
        while conns and not self._stopping:
            try:
                ready = wait(conns, READ_INTERVAL_S)
            except OSError:  # the executor closed the pipes: the engine is shutting down
                return
            for conn in ready:
                assert isinstance(conn, Connection)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):  # the rank is gone: the executor reports it
                    conns.remove(conn)
                    continue
                self._on_message(kind, payload)

    def _on_message(self, kind: str, payload: Any) -> None:
        done: list[tuple[str, _Transfer]] = []
        with self._cond:
            if kind == "held" and payload in self._transfers:
                self._transfers[payload].num_held += 1
                self._cond.notify_all()
            elif kind == "sent" and payload.transfer_id in self._transfers:
                self._transfers[payload.transfer_id].sent.append(payload)
            elif kind == "released":
                for transfer_id in payload:
                    transfer = self._transfers.get(transfer_id)
                    if transfer is None:
                        continue
                    transfer.num_released += 1
                    if transfer.num_released == len(self._conns):
                        done.append((transfer_id, self._transfers.pop(transfer_id)))
        for transfer_id, transfer in done:
            if len(transfer.sent) == len(self._conns):
                self._on_sent(SentTransfer(transfer_id, transfer.sent[0].num_blocks,
                                           sum(s.num_bytes for s in transfer.sent),
                                           max(s.seconds for s in transfer.sent)))
        if done:
            self._release([transfer_id for transfer_id, _ in done])


class RankKVTransfer:
    """One rank's end, the `kv_connector` of its model runner: a producer rank's block server
    over its own KV tensors, a consumer rank's writes of the shards it is sent."""

    def __init__(self, config: EngineConfig, tp_rank: int, step_conn: Connection,
                 kv_conn: Connection | None) -> None:
        assert config.kv_transfer is not None
        self.transfer: KVTransferConfig = config.kv_transfer
        self.layout = wire.layout_of(config)
        self.tp_rank = tp_rank
        self.server: BlockServer | None = None
        self._step_conn = step_conn
        self._kv_conn = kv_conn
        self._send_lock = threading.Lock()
        self._kv_caches: KVCaches | None = None

    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        """A producer rank opens its block server on kv_port + tp_rank (before the engine's
        HTTP port opens: one in use fails the start) and starts taking holds."""
        self._kv_caches = kv_caches
        if not self.transfer.is_producer or self._kv_conn is None:
            return
        self.server = open_block_server(
            self.transfer, self.layout, self.transfer.kv_port + self.tp_rank,
            lambda block_id: read_block(kv_caches, block_id), block_nbytes(kv_caches),
            lambda transfer_ids: self._send("released", transfer_ids),
            lambda sent: self._send("sent", sent), speaks=self.tp_rank == 0)
        threading.Thread(target=self._take_holds, name="kvasir-kv-holds", daemon=True).start()

    def load(self, load: KVLoad) -> None:
        """This rank's shard of a request's received blocks into its blocks: the executor sends
        it down the step pipe right after the plan."""
        if not load.block_ids:
            return
        kind, payloads = self._step_conn.recv()
        if kind != "kv_blocks":
            raise RuntimeError(f"expected a request's KV blocks on the step pipe, got {kind!r}")
        if payloads is None:  # gone: the executor fails the request after this step
            return
        assert self._kv_caches is not None
        for block_id, payload in zip(load.block_ids, payloads, strict=True):
            write_block(self._kv_caches, block_id, payload)

    def _take_holds(self) -> None:
        assert self._kv_conn is not None and self.server is not None
        while True:
            try:
                kind, payload = self._kv_conn.recv()
            except (EOFError, OSError):  # the engine process is gone; so is this rank soon
                return
            if kind == "hold":
                transfer_id, block_ids, block_hashes, token_ids = payload
                self.server.hold(transfer_id, block_ids, block_hashes, token_ids)
                self._send("held", transfer_id)

    def _send(self, kind: str, payload: Any) -> None:
        assert self._kv_conn is not None
        with self._send_lock:
            try:
                self._kv_conn.send((kind, payload))
            except OSError:
                pass  # the engine process is gone
