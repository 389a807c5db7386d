"""bench/peer_steps.py: the loop that drives Kvasir and vLLM alike for bench/step_profile.py
`--vllm-dir`, over a fake engine (no timing is asserted: only what the loop counts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peer_steps import classify, drive  # noqa: E402


def test_classify_charges_the_steps_above_decode_to_their_prompt_tokens() -> None:
    decode = {"seconds": 0.010, "prompt_tokens": 0, "waiting": 0, "output_tokens": 4}
    steps = [decode] * 5 + [
        {"seconds": 0.110, "prompt_tokens": 100, "waiting": 1, "output_tokens": 4},
        # a chunk of a prompt whose first token comes later: waiting, no tokens charged yet
        {"seconds": 0.060, "prompt_tokens": 0, "waiting": 1, "output_tokens": 3}]
    result = classify(steps)
    assert result["decode_only_steps"] == 5
    assert result["decode_only_step_ms"] == pytest.approx(10.0)
    assert result["per_prompt_token_ms"] == pytest.approx((100 + 50) / 100)
    assert result["output_tokens_per_s"] == pytest.approx(27 / 0.22)


def test_drive_keeps_the_concurrency_and_counts_first_tokens() -> None:
    """A fake engine: a request's first step is its prefill (its first token), then one token a
    step until its max_tokens. Three requests of 10 tokens at a time: every 10th step starts
    three new ones (a step with prompts waiting), the 9 between are decode-only."""
    jobs = [{"prompt": f"p{i}", "max_tokens": 10, "prompt_tokens": 10 + i} for i in range(40)]
    work = {"jobs": jobs, "concurrency": 3, "warmup_steps": 2, "steps": 20, "profile_steps": 0}
    live: dict[str, list[int]] = {}  # id -> [tokens so far, max_tokens]
    added: list[str] = []
    most = 0

    def add(req_id: str, job: dict) -> None:
        live[req_id] = [0, job["max_tokens"]]
        added.append(req_id)

    def step() -> list[tuple[str, int, bool]]:
        nonlocal most
        most = max(most, len(live))
        out = []
        for req_id, state in list(live.items()):
            state[0] += 1
            out.append((req_id, 1, state[0] == state[1]))
            if state[0] == state[1]:
                del live[req_id]
        return out

    result = drive(add, step, work, profile=False)
    assert most == 3
    assert added == [f"r{i}" for i in range(9)]  # steps 0, 10 and 20 each start three
    # measured: steps 2..21; 10 and 20 start requests, the other 18 are decode-only
    assert result["decode_only_steps"] == 18
    assert result["ops_ms_per_step"] == {}
