"""The tenant reaches the scheduler from `LLMEngine.add_request` with a real (tiny, random
weights) model: a light tenant's request overtakes a flooding tenant's backlog under `fair`,
and waits behind it under `fcfs`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import tiny_engine_config, write_checkpoint
from kvasir_engine.core.request import ANONYMOUS_TENANT, SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_light_tenants_first_token_under_a_flood(tmp_path: Path, policy: str) -> None:
    base = tiny_engine_config(write_checkpoint(tmp_path / "llama", "llama"))
    config = dataclasses.replace(base, scheduler=dataclasses.replace(
        base.scheduler, max_num_seqs=2, policy=policy))
    engine = LLMEngine.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"heavy-{i}", [3 + i, 4, 5, 6], params, tenant_id="heavy")
    engine.step()
    engine.add_request("light-0", [7, 8, 9], params, tenant_id="light")
    engine.add_request("anon-0", [9, 8, 7], params)
    first_token_order: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first_token_order:
                first_token_order.append(out.request_id)
    engine.shutdown()
    light_at = first_token_order.index("light-0")
    if policy == "fair":
        assert light_at <= 4  # the two running heavy requests, at most one more on a tie
    else:
        assert first_token_order[-2:] == ["light-0", "anon-0"]  # behind all eight
    assert engine.core.scheduler.fair_share.counter(ANONYMOUS_TENANT) > 0
