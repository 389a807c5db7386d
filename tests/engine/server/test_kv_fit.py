"""The "can this request ever fit" boundary, end to end: the server's 400 and the scheduler
answer the same question (`Scheduler.fit_error`) with usable blocks, which exclude the reserved
null block 0. The KV cache here is exactly as large as the start-up check allows (blocks for
--max-model-len, null block included), so the usable blocks hold less than --max-model-len and
the KV check, not the context-length one, decides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness import live_server, tiny_config

BLOCK_SIZE = 4
NUM_BLOCKS = 10
MAX_MODEL_LEN = NUM_BLOCKS * BLOCK_SIZE
# The tiny checkpoint: 2 layers x 2 KV heads x head_dim 16, K and V, float32.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE
NUM_USABLE_SLOTS = (NUM_BLOCKS - 1) * BLOCK_SIZE


def test_a_request_needing_exactly_the_usable_blocks_runs_one_more_block_is_400(
        tiny_model: Path) -> None:
    base = tiny_config(tiny_model, kv_bytes=NUM_BLOCKS * BLOCK_BYTES)
    config = dataclasses.replace(
        base, model=dataclasses.replace(base.model, max_model_len=MAX_MODEL_LEN),
        scheduler=dataclasses.replace(base.scheduler, max_model_len=MAX_MODEL_LEN))
    with live_server(config) as server:
        assert server.state.async_engine.engine_thread.engine.runtime.num_kv_blocks == NUM_BLOCKS
        prompt = [5] * 6
        # The last sampled token needs no KV slot: prompt + max_tokens - 1 slots.
        fits = NUM_USABLE_SLOTS + 1 - len(prompt)
        body = {"model": "test", "prompt": prompt, "max_tokens": fits, "temperature": 0,
                "ignore_eos": True}
        resp = server.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
        assert resp.json()["usage"]["completion_tokens"] == fits

        resp = server.post("/v1/completions", json=body | {"max_tokens": fits + 1})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "max_tokens"
        assert (f"needs {NUM_BLOCKS} KV blocks of {BLOCK_SIZE} tokens, but the whole KV cache "
                f"has {NUM_BLOCKS - 1} blocks") in error["message"]
