"""The scheduler's side of disaggregated prefill (kv_transfer/): a producer's finished request
keeps its blocks for its consumer (`hold_for_consumer`); a consumer's request, admitted with
its prompt's K/V staged, counts those tokens as computed and tells the runner where to write
them (`num_loaded_tokens_of`, `take_kv_load`). Plain bookkeeping over the KV manager; the bytes
never come near the core.
"""

from __future__ import annotations

from kvasir_engine.core.outputs import KVHold, KVLoad
from kvasir_engine.core.request import KVLoadSpec, Request
from kvasir_engine.kv.kv_cache_manager import KVCacheManager


def hold_for_consumer(request: Request, kv: KVCacheManager) -> KVHold:
    """A producer's finished request: the blocks of its prompt's all-but-last tokens stay held
    (`KVCacheManager.hold`) until released; the consumer recomputes the last one."""
    num_tokens = request.num_prompt_tokens - 1
    block_ids, block_hashes = kv.hold(request, num_tokens)
    return KVHold(block_ids, list(block_hashes), request.prompt_token_ids, num_tokens)


def num_loaded_tokens_of(load: KVLoadSpec | None, num_hit_tokens: int, block_size: int) -> int:
    """Tokens beyond the prefix-cache hits whose K/V a request brought staged; 0 when it
    brought none, or when the cache lost a block before the staged ones since the fetch (the
    request then prefills here: it never decodes from a partial cache)."""
    if load is None or num_hit_tokens < load.first_block * block_size:
        return 0
    return max(load.num_tokens - num_hit_tokens, 0)


def take_kv_load(request: Request, kv: KVCacheManager, num_hit_tokens: int,
                 num_loaded_tokens: int) -> KVLoad | None:
    """The runner's instructions for a request's staged K/V at its admission (its blocks are
    allocated): which staged blocks go into which of its blocks, or none (drop them). Taken off
    the request: after a preemption it is recomputed like any other."""
    load, request.kv_load = request.kv_load, None
    if load is None:
        return None
    first = num_hit_tokens // kv.block_size
    end = kv.num_blocks_for(num_hit_tokens + num_loaded_tokens)
    block_ids = kv.get_block_ids(request.request_id)[first:end] if num_loaded_tokens else []
    return KVLoad(load.staging_id, block_ids, first - load.first_block,
                  is_evicted=num_hit_tokens < load.first_block * kv.block_size)
