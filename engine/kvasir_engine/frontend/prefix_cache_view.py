"""`PrefixCacheView`: what this engine's prefix cache holds, for a router to read (KV events).

The gateway's precise prefix routing (docs/gateway.md, "Precise prefix routing") scores replicas
by the blocks each one really holds, as llm-d's precise prefix-cache scorer does from vLLM's KV
cache events. Here the engine thread drains the block pool's events after every step
(`apply`, O(changes)) into this mirror: the set of held block hashes and a bounded log of the
changes, both under one lock, since the HTTP loop reads them from another thread (`since`).

A reader polls with the `instance` and `seq` of its last answer and gets the changes after it;
a reader that is new, lagged past the log, or talking to a restarted engine (another instance
id) gets the whole set instead (`reset`). Hashes travel as the first 8 bytes of the engine's
sha256 chain hash (kv/hashing.py), in hex: plenty for routing, a quarter of the bytes. They are
salted per tenant, so equal prompts of two tenants never share a hash; the view says nothing a
caller could not learn by sending the prompt, which is why only the trusted gateway may read it
(server/api.py).

`prefix_block_hashes` is the same chain for a prompt the caller hands in, so the router can
match a request against the views without knowing the tokenizer, the chat template or the salt.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from kvasir_engine.kv.block_pool import CLEARED, STORED, KVCacheEvent
from kvasir_engine.kv.hashing import BlockHash, hash_full_blocks

HASH_BYTES = 8  # of the 32-byte chain hash, sent to routers
HASH_SCHEME = "kvasir-sha256-chain-v1"  # kv/hashing.py; a router compares it with its own


def short_hash(block_hash: BlockHash) -> str:
    return block_hash[:HASH_BYTES].hex()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None,
                        max_blocks: int) -> list[str]:
    """The short hashes of the prompt's leading full blocks, as the prefix cache keys them."""
    head = token_ids[:block_size * max_blocks]
    return [short_hash(h) for h in hash_full_blocks(head, block_size, None, cache_salt)]


class PrefixCacheView:
    def __init__(self, block_size: int, max_log_events: int = 100_000) -> None:
        self.block_size = block_size
        self.instance_id = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._log: deque[tuple[int, str, str]] = deque(maxlen=max_log_events)  # (seq, kind, hash)
        self._seq = 0
        self._oldest_seq = 0  # a reader at a seq below this has missed changes

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        """The engine thread's side: one step's events, oldest first."""
        with self._lock:
            for kind, block_hash in events:
                self._seq += 1
                if kind == CLEARED or block_hash is None:
                    self._held.clear()
                    self._log.clear()
                    self._oldest_seq = self._seq
                    continue
                short = short_hash(block_hash)
                if kind == STORED:
                    self._held.add(short)
                else:
                    self._held.discard(short)
                if len(self._log) == self._log.maxlen:
                    self._oldest_seq = self._log[0][0]
                self._log.append((self._seq, kind, short))

    def num_leading_held(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of a prompt's leading blocks the cache holds (a hint: it may change)."""
        with self._lock:
            for i, block_hash in enumerate(block_hashes):
                if short_hash(block_hash) not in self._held:
                    return i
            return len(block_hashes)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def since(self, instance_id: str | None, seq: int | None) -> dict[str, Any]:
        """The changes after `seq` of `instance_id`, or the whole set (`reset: true`)."""
        with self._lock:
            answer: dict[str, Any] = {"instance": self.instance_id, "seq": self._seq,
                                      "block_size": self.block_size, "hash": HASH_SCHEME,
                                      "hash_bytes": HASH_BYTES}
            if (seq is None or instance_id != self.instance_id
                    or not self._oldest_seq <= seq <= self._seq):
                return {**answer, "reset": True, "stored": sorted(self._held), "removed": []}
            newer = []
            for event in reversed(self._log):  # newest first, down to the reader's seq
                if event[0] <= seq:
                    break
                newer.append(event)
            net: dict[str, bool] = {}  # hash -> held after its last change
            for _, kind, short in reversed(newer):
                net[short] = kind == STORED
            return {**answer, "reset": False,
                    "stored": [h for h, is_held in net.items() if is_held],
                    "removed": [h for h, is_held in net.items() if not is_held]}
