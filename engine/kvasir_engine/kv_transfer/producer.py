"""`BlockServer`: a producer's side of disaggregated prefill.

The engine thread hands it each finished prompt's held blocks (`hold`); a consumer connects to
`kv_ip:kv_port`, says which transfer it wants and from which block on (the ones before it has
by prefix hash), and gets the header and the blocks streamed one by one (wire.py). A transfer
is served once: when it ends (sent, or the consumer went away) or when nobody asked for it
within `hold_timeout_s`, its blocks go back (`release`, to the engine thread). Reads of a held
block race nothing: nobody writes a block that is held and full, and a held block is never
handed to another request until it is released.

Threads, not the event loop: one accepts, one serves each connection (a socket timeout bounds
each), one expires holds.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvasir_engine.config import KVTransferConfig
from kvasir_engine.kv_transfer import wire

logger = logging.getLogger(__name__)

# A consumer that stops reading (or sending) for this long loses its transfer.
SOCKET_TIMEOUT_S = 10.0
# Connections served at once; more wait in the listen backlog (a flood costs no threads).
MAX_CONNECTIONS = 64


@dataclass
class Held:
    transfer_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    token_ids: list[int]
    deadline: float  # monotonic


@dataclass
class SentTransfer:
    """What one served transfer cost, for the metrics."""

    transfer_id: str
    num_blocks: int
    num_bytes: int
    seconds: float


def open_block_server(transfer: KVTransferConfig, layout: dict[str, Any], port: int,
                      read_block: Callable[[int], bytes], block_nbytes: int,
                      release: Callable[[list[str]], None],
                      on_sent: Callable[[SentTransfer], None], speaks: bool = True) -> BlockServer:
    """`transfer`'s block server on `port` of its kv_ip; ValueError (one line: a start-up
    failure) when it cannot listen."""
    try:
        return BlockServer(transfer.kv_ip, port, layout, transfer.hold_timeout_s, read_block,
                           block_nbytes, release, on_sent,
                           is_torch_dist=transfer.kv_connector == "TorchDistConnector",
                           speaks=speaks)
    except OSError as e:
        raise ValueError(f"--kv-transfer-config: cannot listen on {transfer.kv_ip}:{port}: "
                         f"{e.strerror or e}") from None


class BlockServer:
    def __init__(self, host: str, port: int, layout: dict[str, Any], hold_timeout_s: float,
                 read_block: Callable[[int], bytes], block_nbytes: int,
                 release: Callable[[list[str]], None],
                 on_sent: Callable[[SentTransfer], None] | None = None,
                 is_torch_dist: bool = False, speaks: bool = True) -> None:
        """`is_torch_dist`: blocks go over a torch.distributed group (dist_plane.py), not in
        the TCP stream. `speaks`: this server logs refusals and expiries; of a
        tensor-parallel producer's servers, which all see the same ones, only rank 0's does."""
        self._speaks = speaks
        self._layout = layout
        self._hold_timeout_s = hold_timeout_s
        self._read_block = read_block
        self._block_nbytes = block_nbytes
        self._release = release
        self._on_sent = on_sent
        self._cond = threading.Condition()
        self._held: dict[str, Held] = {}
        self._stopping = False
        self._mismatched_peers: set[str] = set()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._store: Any = None
        if is_torch_dist:
            from kvasir_engine.kv_transfer.dist_plane import open_store

            self._store = open_store(host, SOCKET_TIMEOUT_S)
        self._socket = socket.create_server((host, port), reuse_port=False)
        self._socket.settimeout(0.5)
        self.port = int(self._socket.getsockname()[1])
        self._threads = [threading.Thread(target=self._accept, name="kvasir-kv-accept",
                                          daemon=True),
                         threading.Thread(target=self._expire, name="kvasir-kv-expire",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    @property
    def num_held(self) -> int:
        with self._cond:
            return len(self._held)

    def hold(self, transfer_id: str, block_ids: list[int], block_hashes: list[bytes],
             token_ids: list[int]) -> None:
        with self._cond:
            self._held[transfer_id] = Held(transfer_id, block_ids, block_hashes, token_ids,
                                           time.monotonic() + self._hold_timeout_s)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._socket.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._stopping:
            if not self._slots.acquire(timeout=0.5):
                continue
            try:
                conn, peer = self._socket.accept()
            except TimeoutError:
                self._slots.release()
                continue
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"),
                             name="kvasir-kv-serve", daemon=True).start()

    def _expire(self) -> None:
        """Frees the holds nobody began to fetch within `hold_timeout_s` (one being served
        left `_held` and is released when its serving ends)."""
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                expired = [h.transfer_id for h in self._held.values() if h.deadline <= now]
                for transfer_id in expired:
                    del self._held[transfer_id]
                if expired and self._speaks:
                    logger.warning("KV transfer: no consumer fetched %s within %gs; freed",
                                   expired, self._hold_timeout_s)
                if expired:
                    self._release(expired)
                deadlines = [h.deadline for h in self._held.values()]
                self._cond.wait(max(min(deadlines) - now, 0.01) if deadlines else None)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        held: Held | None = None
        try:
            with conn:
                conn.settimeout(SOCKET_TIMEOUT_S)
                ask = wire.decode_json(_recv_exactly(conn, wire.json_length(
                    _recv_exactly(conn, wire.JSON_HEAD_BYTES))))
                mismatch = wire.layout_mismatch(self._layout, ask.get("layout"))
                if mismatch is not None:
                    if self._speaks and peer.rsplit(":", 1)[0] not in self._mismatched_peers:
                        self._mismatched_peers.add(peer.rsplit(":", 1)[0])
                        logger.error("KV transfer refused: consumer %s differs: %s", peer,
                                     mismatch)
                    conn.sendall(wire.encode_json({"error": "handshake", "message": mismatch,
                                                   "layout": self._layout}))
                    # Its consumer cannot take it and will prefill itself: free it now.
                    held = self._take(ask.get("transfer_id"))
                    return
                if ask.get("hello"):  # a consumer's start-up handshake, and nothing more
                    conn.sendall(wire.encode_json({"ok": True, "layout": self._layout}))
                    return
                held = self._take(ask.get("transfer_id"))
                if held is None:
                    conn.sendall(wire.encode_json({"error": "unknown_transfer", "message":
                                                   "no such transfer held (expired or fetched)"}))
                    return
                self._send(conn, held, ask.get("first_block"))
        except (OSError, RuntimeError, wire.WireError) as e:  # RuntimeError: torch.distributed
            logger.warning("KV transfer to %s failed: %s", peer, e)
        finally:
            self._slots.release()
            if held is not None:
                self._release([held.transfer_id])

    def _take(self, transfer_id: object) -> Held | None:
        with self._cond:
            return self._held.pop(transfer_id, None) if isinstance(transfer_id, str) else None

    def _send(self, conn: socket.socket, held: Held, first_block: object) -> None:
        start = time.monotonic()
        if not isinstance(first_block, int) or not 0 <= first_block <= len(held.block_ids):
            raise wire.WireError("protocol", f"first_block {first_block!r} out of range")
        block_ids = held.block_ids[first_block:]
        header = {"token_ids": held.token_ids,
                  "block_hashes": [h.hex() for h in held.block_hashes],
                  "num_blocks": len(block_ids), "block_nbytes": self._block_nbytes}
        if self._store is None:
            conn.sendall(wire.encode_json(header))
            for block_id in block_ids:  # streamed as read
                conn.sendall(wire.encode_block(self._read_block(block_id)))
        else:
            from kvasir_engine.kv_transfer.dist_plane import send_blocks

            payloads = [self._read_block(block_id) for block_id in block_ids]
            conn.sendall(wire.encode_json({
                **header, "crc32": [zlib.crc32(p) for p in payloads],
                "store_port": self._store.port, "pair": held.transfer_id}))
            send_blocks(self._store, held.transfer_id, payloads, SOCKET_TIMEOUT_S)
        if self._on_sent is not None:
            self._on_sent(SentTransfer(held.transfer_id, len(block_ids),
                                       len(block_ids) * self._block_nbytes,
                                       time.monotonic() - start))


def _recv_exactly(conn: socket.socket, num_bytes: int) -> bytes:
    chunks, remaining = [], num_bytes
    while remaining:
        chunk = conn.recv(min(remaining, 1 << 20))
        if not chunk:
            raise wire.WireError("connection", "the peer closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
