"""`fetch_blocks`: a consumer's side of one transfer, on the event loop.

It connects to the producer's block server, asks for the transfer from the first block it
lacks, checks the header against its own view of the prompt (the same token ids; the same
prefix hashes, so the same salt and model), then reads the blocks one by one, checking each
one's crc32 before keeping it. The whole fetch runs under one timeout; any failure raises
`FetchFailed` with a reason (the fallback metric's label) and keeps nothing, so the caller
prefills locally and never decodes from a partial cache.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

from kvasir_engine.kv.hashing import BlockHash
from kvasir_engine.kv_transfer import wire

# The producer's refusals the consumer passes on as fallback reasons.
_REFUSALS = ("handshake", "unknown_transfer")


class FetchFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def handshake(host: str, port: int, layout: dict[str, Any], timeout_s: float) -> str | None:
    """A consumer's start-up handshake with a known producer: None when they agree, else one
    line naming every field that differs. OSError when the producer cannot be reached."""
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.sendall(wire.encode_json({"layout": layout, "hello": True}))
        head = _recv(conn, wire.JSON_HEAD_BYTES)
        answer = wire.decode_json(_recv(conn, wire.json_length(head)))
    return wire.layout_mismatch(layout, answer.get("layout"))


def _recv(conn: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        chunk = conn.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError("the producer closed the connection")
        data += chunk
    return data


async def fetch_shards(host: str, port: int, num_ranks: int, **fetch: Any) -> list[list[bytearray]]:
    """Every tensor-parallel rank's shard of the blocks (`fetch_blocks` from rank r's server on
    `port + r`), all at once under the one timeout; `[rank][block]`. Every rank is asked, so
    each frees its part at once whatever the others do; the first failure by rank is raised,
    a refused handshake before any other (it names the misfit, and is remembered)."""
    results = await asyncio.gather(*(fetch_blocks(host, port + rank, **fetch)
                                     for rank in range(num_ranks)), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    for failure in failures:
        if not isinstance(failure, FetchFailed):
            raise failure
    if failures:
        refused = [f for f in failures if isinstance(f, FetchFailed) and f.reason == "handshake"]
        raise (refused or failures)[0]
    return [r for r in results if not isinstance(r, BaseException)]


async def fetch_blocks(host: str, port: int, *, layout: dict[str, Any], transfer_id: str,
                       first_block: int, num_blocks: int, block_nbytes: int,
                       token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                       timeout_s: float) -> list[bytearray]:
    """Blocks `[first_block, first_block + num_blocks)` of the producer's transfer."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                return await _exchange(reader, writer, host, layout, transfer_id, first_block,
                                       num_blocks, block_nbytes, token_ids, block_hashes,
                                       timeout_s)
            finally:
                writer.close()
    except TimeoutError:
        raise FetchFailed("timeout", f"no whole transfer within {timeout_s:g}s") from None
    except wire.WireError as e:
        raise FetchFailed(e.reason, str(e)) from None
    except (OSError, asyncio.IncompleteReadError) as e:
        raise FetchFailed("connection", f"{type(e).__name__}: {e}") from None


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
                    layout: dict[str, Any], transfer_id: str, first_block: int,
                    num_blocks: int, block_nbytes: int, token_ids: Sequence[int],
                    block_hashes: Sequence[BlockHash], timeout_s: float) -> list[bytearray]:
    writer.write(wire.encode_json({"layout": layout, "transfer_id": transfer_id,
                                   "first_block": first_block}))
    await writer.drain()
    length = wire.json_length(await reader.readexactly(wire.JSON_HEAD_BYTES))
    header = wire.decode_json(await reader.readexactly(length))
    if "error" in header:
        reason = header["error"] if header["error"] in _REFUSALS else "refused"
        # A refused handshake is told from this side: "block_size 8 here, 4 there".
        mismatch = (wire.layout_mismatch(layout, header.get("layout"))
                    if reason == "handshake" else None)
        raise FetchFailed(reason, mismatch or f"the producer refused: {header.get('message')}")
    _check_header(header, first_block, num_blocks, block_nbytes, token_ids, block_hashes)
    if "store_port" in header:  # TorchDistConnector: the blocks come over a process group
        return await _receive_by_torch_dist(header, host, first_block, num_blocks,
                                            block_nbytes, timeout_s)
    blocks: list[bytearray] = []
    for index in range(first_block, first_block + num_blocks):
        size, crc = wire.block_head(await reader.readexactly(wire.BLOCK_HEAD_BYTES),
                                    block_nbytes)
        payload = bytearray(await reader.readexactly(size))
        wire.check_block(payload, crc, index)
        blocks.append(payload)
    return blocks


async def _receive_by_torch_dist(header: dict[str, Any], host: str, first_block: int,
                                 num_blocks: int, block_nbytes: int,
                                 timeout_s: float) -> list[bytearray]:
    from kvasir_engine.kv_transfer.dist_plane import recv_blocks

    crcs, store_port, pair = header.get("crc32"), header.get("store_port"), header.get("pair")
    if (not isinstance(crcs, list) or len(crcs) != num_blocks
            or not isinstance(store_port, int) or not isinstance(pair, str)):
        raise wire.WireError("protocol", "a torch.distributed header without its crc32s, "
                                         "store port or pair")
    try:  # off the event loop: the rendezvous and the recv block (gloo's own timeout bounds them)
        blocks = await asyncio.to_thread(recv_blocks, host, store_port, pair, num_blocks,
                                         block_nbytes, timeout_s)
    except RuntimeError as e:  # torch.distributed's errors (DistBackendError, store timeouts)
        raise FetchFailed("connection", f"torch.distributed: {e}") from None
    for index, (payload, crc) in enumerate(zip(blocks, crcs, strict=True)):
        wire.check_block(payload, crc, first_block + index)
    return blocks


def _check_header(header: dict[str, Any], first_block: int, num_blocks: int,
                  block_nbytes: int, token_ids: Sequence[int],
                  block_hashes: Sequence[BlockHash]) -> None:
    if header.get("token_ids") != list(token_ids):
        raise FetchFailed("mismatch", "the producer's prompt differs from this request's")
    theirs = header.get("block_hashes")
    if theirs != [h.hex() for h in block_hashes]:
        raise FetchFailed("mismatch", "the producer's block hashes differ (another salt, "
                                      "tenant or hashing)")
    if header.get("num_blocks") != num_blocks or header.get("block_nbytes") != block_nbytes:
        raise FetchFailed("mismatch", f"the producer offers {header.get('num_blocks')} blocks "
                                      f"of {header.get('block_nbytes')} bytes, expected "
                                      f"{num_blocks} of {block_nbytes}")
