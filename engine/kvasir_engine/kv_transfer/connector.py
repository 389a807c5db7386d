"""`KVConnector`: one engine's end of disaggregated prefill and decode (docs/disaggregation.md).

One object per engine, made from `--kv-transfer-config`, with vLLM's split of duties:

- the runner registers its KV tensors (`register_kv_caches`) and, on a consumer, writes a
  request's staged blocks into the blocks the scheduler gave it (`load`) before the step that
  decodes from them;
- the engine thread (`LLMEngine`) hands a producer's held blocks to the block server (`hold`)
  and takes back the ones the server is done with (`take_released`; `set_wake` makes the engine
  thread step for them even when idle);
- the server (event loop) asks a consumer's blocks of the producer (`receive`) before the
  request is admitted, and drops them if the request ends first (`discard`).

The transport is TCP (producer.py, consumer.py, wire.py): it runs across nodes and on CPU.
Under tensor parallelism this object lives in the engine process, which holds no KV tensor:
each rank serves its own shard (tensor_parallel.py), a decode request's shards are fetched here,
one per rank, and the executor hands each rank its own (`take_staged`).
`TransferStats` counts what went through and why a request fell back to a local prefill.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvasir_engine.config import EngineConfig, KVTransferConfig
from kvasir_engine.core.outputs import KVHold, KVLoad
from kvasir_engine.core.request import KVLoadSpec
from kvasir_engine.kv.hashing import hash_full_blocks
from kvasir_engine.kv_transfer import wire
from kvasir_engine.kv_transfer.blocks import (
    KVCaches,
    block_nbytes,
    read_block,
    shard_nbytes,
    write_block,
)
from kvasir_engine.kv_transfer.consumer import FetchFailed, fetch_shards, handshake
from kvasir_engine.kv_transfer.producer import BlockServer, SentTransfer, open_block_server
from kvasir_engine.kv_transfer.tensor_parallel import RankServers

logger = logging.getLogger(__name__)

# Why a consumer's request prefilled locally instead (the fallback metric's label values).
FALLBACK_REASONS = ("connection", "timeout", "checksum", "protocol", "handshake",
                    "unknown_transfer", "mismatch", "cache_full", "evicted", "refused")

# Why a request admitted with received blocks failed: they were dropped before its first step.
BLOCKS_GONE = "its received KV blocks are gone (the request was aborted while it waited)"


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request's `kv_transfer_params` (vLLM's names): where its prompt was run."""

    remote_engine_id: str
    remote_host: str
    remote_port: int  # its tensor-parallel rank r serves on remote_port + r
    remote_request_id: str
    tp_size: int = 1  # the producer's ranks (vLLM's tp_size)


class TransferStats:
    """Counters the metrics read (thread-safe): per direction, transfers, blocks, bytes and
    seconds; the consumer's fallbacks by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_blocks = {"sent": 0, "received": 0}
        self.num_bytes = {"sent": 0, "received": 0}
        self.fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)
        self._seconds: list[tuple[str, float]] = []  # not yet observed by the metrics

    def add_transfer(self, direction: str, num_blocks: int, num_bytes: int,
                     seconds: float) -> None:
        with self._lock:
            self.num_blocks[direction] += num_blocks
            self.num_bytes[direction] += num_bytes
            self._seconds.append((direction, seconds))

    def add_fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1

    def take_seconds(self) -> list[tuple[str, float]]:
        with self._lock:
            taken, self._seconds = self._seconds, []
            return taken


class KVConnector:
    def __init__(self, config: EngineConfig) -> None:
        if config.kv_transfer is None:
            raise ValueError("a KV connector needs --kv-transfer-config")
        self.config: KVTransferConfig = config.kv_transfer
        self.layout = wire.layout_of(config)
        self.block_size = config.cache.block_size
        self.tp_size = config.parallel.tensor_parallel_size
        self.stats = TransferStats()
        self.server: BlockServer | RankServers | None = None
        self._lock = threading.Lock()
        self._kv_caches: KVCaches | None = None
        # Bytes of one block on one rank (its KV heads), and over every rank.
        self.shard_nbytes = shard_nbytes(config) if self.tp_size > 1 else 0
        self.block_nbytes = self.tp_size * self.shard_nbytes
        self._released: list[str] = []
        self._wake: Callable[[], None] | None = None
        self._staged: dict[str, list[list[bytearray]]] = {}  # [rank][block]
        self._num_staged_bytes = 0
        self._ids = itertools.count()
        self._mismatched_engines: set[str] = set()

    def check_producers(self) -> None:
        """The start-up handshake with the producers the config names (a consumer's): one that
        differs fails the start with one line (ValueError; it logs its own); one that cannot
        be reached yet is only logged, and checked again at its first transfer."""
        for address in self.config.producers:
            host, _, port = address.rpartition(":")
            try:
                mismatch = handshake(host, int(port), self.layout,
                                     self.config.transfer_timeout_s)
            except (OSError, wire.WireError) as e:
                logger.warning("KV transfer: producer %s not reachable at start (%s); it is "
                               "checked at its first transfer", address, e)
                continue
            if mismatch is not None:
                raise ValueError(f"--kv-transfer-config: producer {address} differs from this "
                                 f"engine: {mismatch}")

    # -- the runner's side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        """The runner's KV tensors, once allocated; a producer opens its block server here,
        before the HTTP port (a kv_port in use fails the start)."""
        self._kv_caches = kv_caches
        self.block_nbytes = self.shard_nbytes = block_nbytes(kv_caches)
        if self.config.is_producer:
            self.server = open_block_server(
                self.config, self.layout, self.config.kv_port,
                lambda block_id: read_block(kv_caches, block_id), self.block_nbytes,
                self._release, self._on_sent)

    def attach_ranks(self, kv_conns: Sequence[Connection]) -> None:
        """Under tensor parallelism, once the ranks run: a producer's holds go to their block
        servers over these pipes, one per rank (tensor_parallel.py)."""
        if self.config.is_producer:
            self.server = RankServers(kv_conns, self.config.kv_port, self._release,
                                      self._on_sent)

    def load(self, load: KVLoad) -> None:
        """Write a request's staged blocks into its blocks (engine thread, before the forward
        pass); KeyError when they are gone (the request was aborted while waiting)."""
        shards = self.take_staged(load)
        if shards is None:
            raise KeyError(load.staging_id)
        assert self._kv_caches is not None
        for block_id, payload in zip(load.block_ids, shards[0], strict=True):
            write_block(self._kv_caches, block_id, payload)

    def take_staged(self, load: KVLoad) -> list[list[bytearray]] | None:
        """A request's staged blocks, `[rank][block]`, the ones `load.block_ids` take (none
        when the cache lost a block before them: counted `evicted`); None when they are gone
        (the request was aborted while waiting)."""
        with self._lock:
            shards = self._staged.pop(load.staging_id, None)
            if shards is None:
                return None
            self._num_staged_bytes -= _num_bytes(shards)
        if not load.block_ids and load.is_evicted:
            self.stats.add_fallback("evicted")
        end = load.first_staged + len(load.block_ids)
        return [shard[load.first_staged:end] for shard in shards]

    # -- the engine thread's side ----------------------------------------------------------------
    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake()` makes the engine thread run a step soon (to free released holds)."""
        self._wake = wake

    def hold(self, request_id: str, hold: KVHold) -> dict[str, Any]:
        """A producer's finished request: its blocks wait for the consumer; the answer's
        `kv_transfer_params` say where (vLLM's names)."""
        assert self.server is not None, "hold() on an engine that is not a producer"
        self.server.hold(request_id, hold.block_ids, hold.block_hashes, hold.token_ids)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.config.resolved_engine_id,
                "remote_host": self.config.kv_ip, "remote_port": self.server.port,
                "remote_request_id": request_id, "remote_block_ids": hold.block_ids,
                "tp_size": self.layout["tensor_parallel_size"]}

    def take_released(self) -> list[str]:
        with self._lock:
            released, self._released = self._released, []
            return released

    def _release(self, transfer_ids: list[str]) -> None:
        with self._lock:
            self._released.extend(transfer_ids)
        if self._wake is not None:
            self._wake()

    def _on_sent(self, sent: SentTransfer) -> None:
        self.stats.add_transfer("sent", sent.num_blocks, sent.num_bytes, sent.seconds)

    # -- the server's side (event loop) ----------------------------------------------------------
    async def receive(self, remote: RemotePrefill, token_ids: Sequence[int],
                      cache_salt: str | None, num_held_blocks: int) -> KVLoadSpec | None:
        """Fetch a decode request's prompt K/V, from the first block this engine does not hold
        (`num_held_blocks`, by prefix hash) on, and stage it; None (the reason counted) when
        the request must prefill here instead."""
        num_tokens = len(token_ids) - 1
        num_blocks = -(-num_tokens // self.block_size)
        first_block = min(num_held_blocks, num_tokens // self.block_size)
        num_wanted = num_blocks - first_block
        if num_wanted <= 0:
            return None  # the whole prompt is cached here already (or it has one token)
        try:
            self._check_peer(remote)
            self._reserve(num_wanted * self.block_nbytes)
        except FetchFailed as e:
            self.stats.add_fallback(e.reason)
            logger.warning("KV transfer of %s: prefilling here: %s", remote.remote_request_id, e)
            return None
        start = time.monotonic()
        try:
            shards = await fetch_shards(
                remote.remote_host, remote.remote_port, remote.tp_size, layout=self.layout,
                transfer_id=remote.remote_request_id, first_block=first_block,
                num_blocks=num_wanted, block_nbytes=self.shard_nbytes, token_ids=token_ids,
                block_hashes=hash_full_blocks(token_ids[:num_tokens], self.block_size, None,
                                              cache_salt),
                timeout_s=self.config.transfer_timeout_s)
            if len(shards) != self.tp_size:  # the handshake passed: the params lied
                raise FetchFailed("mismatch", f"{len(shards)} shards for "
                                              f"{self.tp_size} tensor-parallel ranks")
        except BaseException as e:
            self._unreserve(num_wanted * self.block_nbytes)
            if not isinstance(e, FetchFailed):
                raise  # cancelled: the client went away
            self.stats.add_fallback(e.reason)
            if e.reason == "handshake":
                self._mismatched_engines.add(remote.remote_engine_id)
                logger.error("KV transfer refused: producer %s differs: %s",
                             remote.remote_engine_id, e)
            else:
                logger.warning("KV transfer of %s from %s failed (%s), prefilling here: %s",
                               remote.remote_request_id, remote.remote_engine_id, e.reason, e)
            return None
        self.stats.add_transfer("received", num_wanted, num_wanted * self.block_nbytes,
                                time.monotonic() - start)
        staging_id = f"kv-{next(self._ids)}"
        with self._lock:
            self._staged[staging_id] = shards
        return KVLoadSpec(staging_id, first_block, num_wanted, num_tokens)

    def discard(self, staging_id: str) -> None:
        """Drop staged blocks the runner never took (their request ended first)."""
        with self._lock:
            shards = self._staged.pop(staging_id, None)
            if shards is not None:
                self._num_staged_bytes -= _num_bytes(shards)

    @property
    def num_staged(self) -> int:
        with self._lock:
            return len(self._staged)

    def _check_peer(self, remote: RemotePrefill) -> None:
        if remote.remote_engine_id in self._mismatched_engines:
            raise FetchFailed("handshake", f"producer {remote.remote_engine_id} differs "
                                           f"from this engine (see the first refusal)")

    def _reserve(self, num_bytes: int) -> None:
        with self._lock:
            if self._num_staged_bytes + num_bytes > self.config.kv_buffer_size:
                raise FetchFailed("cache_full", f"{num_bytes} bytes would overflow "
                                                f"kv_buffer_size {self.config.kv_buffer_size}")
            self._num_staged_bytes += num_bytes

    def _unreserve(self, num_bytes: int) -> None:
        with self._lock:
            self._num_staged_bytes -= num_bytes

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()


def _num_bytes(shards: list[list[bytearray]]) -> int:
    return sum(len(block) for shard in shards for block in shard)
