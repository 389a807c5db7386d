"""Chained block hashes: the keys of the prefix cache.

A full block's hash covers its parent block's hash and its own token ids, so equal hashes mean
equal whole prefixes, not just equal blocks. The first block also covers an optional cache salt,
which then flows down the chain: two tenants with different salts never share a block. sha256 over
a fixed little-endian encoding keeps hashes identical across processes, ranks and machines
(Python's `hash()` is salted per process). Only full blocks are hashed: a partial block's
contents still change as the request grows.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

# Domain tag for the root of every chain, so a root can never collide with a child.
_ROOT_TAG = b"kvasir-kv-root-v1"


def _root_prefix(cache_salt: str | None) -> bytes:
    if cache_salt is None:
        return _ROOT_TAG + b"\x00"
    salt = cache_salt.encode("utf-8")
    return _ROOT_TAG + b"\x01" + struct.pack("<Q", len(salt)) + salt


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      cache_salt: str | None = None) -> BlockHash:
    """The hash of one block given its parent's hash (None for the first block).

    `cache_salt` is only read for the first block: later blocks inherit it through the chain.
    """
    hasher = hashlib.sha256()
    hasher.update(parent_hash if parent_hash is not None else _root_prefix(cache_salt))
    try:
        hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error as exc:
        raise ValueError(f"token_ids: every token id must be a 64-bit integer ({exc})") from exc
    return BlockHash(hasher.digest())


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent_hash: BlockHash | None,
                     cache_salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`.

    `token_ids` must start at a block boundary; a trailing partial block is ignored.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size],
                                        cache_salt)
        hashes.append(parent_hash)
    return hashes
