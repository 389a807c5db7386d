"""The block protocol between a producer's block server and a consumer, over one TCP stream.

Torch-free framing, shared by both sides (and by tests that play a broken producer):

1. consumer -> producer: a JSON frame `{"layout": ..., "transfer_id": ..., "first_block": k}`;
   `layout` is the handshake (`layout_of`): model, KV dtype, block size and parallel layout.
2. producer -> consumer: a JSON frame, `{"error": reason, "message": ...}` or the transfer's
   header `{"token_ids": [...], "block_hashes": [hex, ...], "num_blocks": n, "block_nbytes": B}`
   (`num_blocks` counts the blocks from `first_block` on: the ones the consumer lacks).
3. producer -> consumer: `num_blocks` block frames, each `[u32 length][u32 crc32][payload]`,
   streamed as they are read; the consumer checks every checksum before it keeps a block.

A JSON frame is `[u32 length][UTF-8 JSON]`. Lengths are bounded, so a peer that sends garbage
costs a refused transfer, never an unbounded read.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from kvasir_engine.config import EngineConfig

_U32 = struct.Struct("<I")
_BLOCK_HEAD = struct.Struct("<II")
# A header carries the prompt's token ids and hashes: bounded far above any max_model_len.
MAX_JSON_BYTES = 64 << 20
# One block of K and V over every layer: bounded far above any model's.
MAX_BLOCK_BYTES = 1 << 30


class WireError(Exception):
    """The peer broke the protocol; `reason` is a fallback reason (metrics label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def layout_of(config: EngineConfig) -> dict[str, Any]:
    """What two engines must agree on for one's KV blocks to mean the same in the other."""
    arch = config.model.arch
    return {
        "kv_connector": config.kv_transfer.kv_connector if config.kv_transfer else None,
        "model": config.model.served_model_name,
        "architecture": arch.architecture,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "kv_cache_dtype": config.cache.resolved_kv_cache_dtype(config.model.dtype),
        "block_size": config.cache.block_size,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
    }


def layout_mismatch(mine: dict[str, Any], theirs: object) -> str | None:
    """One line naming every field that differs ("block_size 4 here, 8 there"), or None."""
    if not isinstance(theirs, dict):
        return "the peer sent no layout"
    diffs = [f"{key} {mine[key]!r} here, {theirs.get(key)!r} there"
             for key in mine if theirs.get(key) != mine[key]]
    return "; ".join(diffs) or None


def encode_json(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _U32.pack(len(data)) + data


def decode_json(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError("protocol", f"a frame is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("protocol", "a frame is not a JSON object")
    return obj


def json_length(head: bytes) -> int:
    length: int = _U32.unpack(head)[0]
    if length > MAX_JSON_BYTES:
        raise WireError("protocol", f"a JSON frame of {length} bytes is over the bound")
    return length


def encode_block(payload: bytes) -> bytes:
    return _BLOCK_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


BLOCK_HEAD_BYTES = _BLOCK_HEAD.size
JSON_HEAD_BYTES = _U32.size


def block_head(head: bytes, expected_nbytes: int) -> tuple[int, int]:
    """(length, crc32) of a block frame; the length must be the header's block size."""
    length, crc = _BLOCK_HEAD.unpack(head)
    if length != expected_nbytes or length > MAX_BLOCK_BYTES:
        raise WireError("protocol", f"a block of {length} bytes, expected {expected_nbytes}")
    return length, crc


def check_block(payload: bytes | bytearray, crc: int, index: int) -> None:
    if zlib.crc32(payload) != crc:
        raise WireError("checksum", f"block {index} arrived corrupted (crc32 mismatch)")
