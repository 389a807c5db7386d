"""`KVCacheManager`: per-request block tables over one `BlockPool`, with prefix caching.

The scheduler asks two things of it each step: which blocks of a new request's prefix are already
cached (`get_computed_blocks`), and room for the tokens it plans to compute (`allocate_slots`,
None when the pool is short, which is the scheduler's cue to preempt). Token positions map to
blocks by `position // block_size`; the runner turns block tables into slot mappings. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvasir_engine.kv.block import KVCacheBlock, KVCacheBlocks
from kvasir_engine.kv.block_pool import BlockPool, KVCacheEvent
from kvasir_engine.kv.hashing import BlockHash, hash_full_blocks
from kvasir_engine.kv.request_view import RequestView


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last snapshot, in tokens."""

    num_queries: int = 0  # tokens of requests admitted (their whole known length)
    num_hits: int = 0  # of which found in the cache


def kv_memory_waste(num_blocks_in_use: int, num_tokens_stored: int, block_size: int) -> float:
    """Fraction of held KV slots that store no token (0 when nothing is held)."""
    num_slots = num_blocks_in_use * block_size
    return 0.0 if num_slots == 0 else 1.0 - num_tokens_stored / num_slots


def _token_range(request: RequestView, start: int, end: int) -> list[int]:
    """`request.all_token_ids[start:end]` without copying the whole sequence."""
    prompt = request.prompt_token_ids
    if end <= len(prompt):
        return prompt[start:end]
    outputs = request.output_token_ids
    if start >= len(prompt):
        return outputs[start - len(prompt):end - len(prompt)]
    return prompt[start:] + outputs[:end - len(prompt)]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # Leading blocks of each request already keyed in the prefix cache.
        self.req_to_num_cached_blocks: dict[str, int] = {}
        # A producer's finished requests' blocks, kept for their consumer (`hold`).
        self.held_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_queries = 0
        self._num_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one request can hold: every usable block."""
        return self.block_pool.num_usable_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether one request of `num_tokens` KV slots fits the pool when nobody else holds a
        block: its blocks against the usable ones (the null block is never handed out)."""
        return self.num_blocks_for(num_tokens) <= self.block_pool.num_usable_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def num_unfilled_slots(self, request: RequestView) -> int:
        """Slots of the request's blocks beyond its computed tokens (its share of waste)."""
        num_slots = len(self.req_to_blocks.get(request.request_id, ())) * self.block_size
        return max(num_slots - request.num_computed_tokens, 0)

    def get_computed_blocks(self, request: RequestView) -> tuple[KVCacheBlocks, int]:
        """The cached blocks of the request's longest cached prefix, and their token count.

        Never the whole sequence: the last token is always recomputed, because its forward pass
        yields the logits of the next token. Nothing for a request that needs the logits of its
        prompt positions (prompt logprobs), as vLLM does; its blocks are still cached for others.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return KVCacheBlocks(), 0
        block_hashes = self._block_hashes(request)
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        return KVCacheBlocks(tuple(hit_blocks)), len(hit_blocks) * self.block_size

    def allocate_slots(self, request: RequestView, num_new_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None = None) -> KVCacheBlocks | None:
        """Room for `num_new_tokens` more tokens after the computed ones; None if the pool is short.

        `new_computed_blocks` (from `get_computed_blocks`, only at admission) join the block
        table first. Blocks that become full with known tokens are keyed in the prefix cache.
        Returns the newly allocated blocks (not the prefix hits), in block-table order.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        request_id = request.request_id
        computed_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        num_held_blocks = len(self.req_to_blocks.get(request_id, ()))
        if computed_blocks and num_held_blocks:
            raise ValueError(f"request {request_id}: prefix-cache hits are only taken at admission")
        num_computed_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_total_tokens = num_computed_tokens + num_new_tokens
        if num_total_tokens > self.max_model_len:
            raise ValueError(f"request {request_id}: {num_total_tokens} tokens exceed "
                             f"max_model_len {self.max_model_len}")
        num_new_blocks = (self.num_blocks_for(num_total_tokens) - num_held_blocks
                          - len(computed_blocks))
        # Hits waiting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        self.block_pool.touch(computed_blocks)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        req_blocks.extend(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            if num_held_blocks == 0:
                self._num_queries += request.num_tokens
                self._num_hits += len(computed_blocks) * self.block_size
            num_full_blocks = min(num_total_tokens, request.num_tokens) // self.block_size
            num_cached_blocks = self.req_to_num_cached_blocks.get(request_id, 0)
            if num_full_blocks > num_cached_blocks:
                self.block_pool.cache_full_blocks(req_blocks, self._block_hashes(request),
                                                  num_cached_blocks, num_full_blocks)
                self.req_to_num_cached_blocks[request_id] = num_full_blocks
        return KVCacheBlocks(tuple(new_blocks))

    def num_blocks(self, request_id: str) -> int:
        """Blocks in the request's block table."""
        return len(self.req_to_blocks.get(request_id, ()))

    def trim(self, request: RequestView, num_tokens: int) -> int:
        """Give back the blocks beyond the first `num_tokens` positions (rejected draft tokens'
        slots); returns how many. Those blocks hold no full block of known tokens, so none of
        them is keyed in the prefix cache."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_kept = self.num_blocks_for(num_tokens)
        if num_kept < self.req_to_num_cached_blocks.get(request.request_id, 0):
            raise ValueError(f"request {request.request_id}: cannot trim to {num_tokens} tokens "
                             f"below its cached blocks")
        tail = blocks[num_kept:]
        del blocks[num_kept:]
        self.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def uncache_uncomputed(self, request: RequestView) -> None:
        """Take the request's blocks beyond its computed tokens out of the prefix cache.

        Blocks are keyed when allocated, before the step that computes them runs; when that
        step fails (`Scheduler.fail_plan`) their contents were never written, and no later
        request may take them as a hit.
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed_blocks = request.num_computed_tokens // self.block_size
        self.block_pool.uncache(blocks[num_computed_blocks:])
        num_cached = self.req_to_num_cached_blocks.get(request.request_id, 0)
        if num_cached > num_computed_blocks:
            self.req_to_num_cached_blocks[request.request_id] = num_computed_blocks

    def free(self, request: RequestView) -> None:
        """Give back every block of the request, tail first, so tails are evicted first."""
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.req_to_block_hashes.pop(request_id, None)
        self.req_to_num_cached_blocks.pop(request_id, None)

    def hold(self, request: RequestView, num_tokens: int) -> tuple[list[int], list[BlockHash]]:
        """A finished request's blocks that hold its first `num_tokens` tokens, kept held (for
        a consumer to fetch) until `release_held`; the rest are freed now. Returns their ids
        and the hashes of the full ones."""
        request_id = request.request_id
        block_hashes = self._block_hashes(request)[:num_tokens // self.block_size]
        blocks = self.req_to_blocks.pop(request_id, [])
        num_kept = self.num_blocks_for(num_tokens)
        self.block_pool.free_blocks(reversed(blocks[num_kept:]))
        self.held_blocks[request_id] = blocks[:num_kept]
        self.req_to_block_hashes.pop(request_id, None)
        self.req_to_num_cached_blocks.pop(request_id, None)
        return [block.block_id for block in blocks[:num_kept]], block_hashes

    def release_held(self, request_id: str) -> bool:
        """Free a held request's blocks; False when it holds none (released already)."""
        blocks = self.held_blocks.pop(request_id, None)
        if blocks is None:
            return False
        self.block_pool.free_blocks(reversed(blocks))
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups since the previous call."""
        stats = PrefixCacheStats(self._num_queries, self._num_hits)
        self._num_queries = self._num_hits = 0
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """Prefix-cache changes (block stored / removed / all cleared) since the last call."""
        return self.block_pool.take_events()

    def _block_hashes(self, request: RequestView) -> list[BlockHash]:
        """Hashes of all full blocks of the request's known tokens, extended incrementally."""
        block_hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        num_full_blocks = request.num_tokens // self.block_size
        if len(block_hashes) < num_full_blocks:
            start = len(block_hashes) * self.block_size
            token_ids = _token_range(request, start, num_full_blocks * self.block_size)
            parent_hash = block_hashes[-1] if block_hashes else None
            block_hashes.extend(hash_full_blocks(token_ids, self.block_size, parent_hash,
                                                 request.cache_salt))
        return block_hashes
