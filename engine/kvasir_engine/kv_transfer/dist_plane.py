"""The torch.distributed data plane (`kv_connector: TorchDistConnector`): a transfer's blocks
move as one tensor over a two-rank process group instead of the TCP stream's frames.

The control plane stays the block server's TCP exchange (wire.py: handshake, header, the
blocks' crc32s); the header names the producer's TCPStore and a key prefix unique to the
transfer, and both sides build a `ProcessGroupGloo` of two ranks on it (producer rank 0,
consumer rank 1), one send / one recv, then drop it. A group per transfer costs a rendezvous
(about 30 ms on a loopback) and keeps transfers independent: no tags to share, no group left
half-broken by a consumer that went away. Gloo moves CPU tensors (this engine's CPU caches, or
GPU blocks copied through the host); NCCL, which would move GPU memory directly, is not built.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
from torch.distributed import (  # type: ignore[attr-defined]
    PrefixStore,
    ProcessGroupGloo,
    Store,
    TCPStore,
)

PRODUCER_RANK, CONSUMER_RANK = 0, 1


def open_store(host: str, timeout_s: float) -> TCPStore:
    """The producer's store, on a free port of `host`, for every transfer's rendezvous."""
    return TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _group(store: Store, pair: str, rank: int, timeout_s: float) -> Any:
    # Any: torch's stubs give this backend no send / recv, which it has.
    return ProcessGroupGloo(PrefixStore(pair, store), rank, 2,
                                 datetime.timedelta(seconds=timeout_s))


def send_blocks(store: Store, pair: str, payloads: list[bytes], timeout_s: float) -> None:
    """The producer's side: the blocks as one [num_blocks, block_nbytes] uint8 tensor."""
    group = _group(store, pair, PRODUCER_RANK, timeout_s)
    blocks = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(
        len(payloads), -1)
    group.send([blocks], CONSUMER_RANK, 0).wait()


def recv_blocks(host: str, store_port: int, pair: str, num_blocks: int, block_nbytes: int,
                timeout_s: float) -> list[bytearray]:
    """The consumer's side (blocking: run it off the event loop)."""
    store = TCPStore(host, store_port, None, False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    group = _group(store, pair, CONSUMER_RANK, timeout_s)
    blocks = torch.empty(num_blocks, block_nbytes, dtype=torch.uint8)
    group.recv([blocks], PRODUCER_RANK, 0).wait()
    return [bytearray(row.numpy().tobytes()) for row in blocks]
