"""/metrics: valid Prometheus text (promtool), vLLM's names, counters that move by what was done."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from harness import API_KEY, LiveServer, live_server, tiny_config

VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "kvasir:step_duration_seconds_bucket",
    "kvasir:batch_size_bucket", "kvasir:scheduled_tokens_per_step_bucket",
]


def test_metrics_pass_promtool(server: LiveServer) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    server.client().completions.create(model="test", prompt="Hello", max_tokens=3)
    text = server.get("/metrics").text
    run = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    problems = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    # promtool's only objections may be to vLLM's own names, which dashboards depend on: the
    # colon, and a histogram vLLM named with "_total".
    unexpected = [p for p in problems
                  if not (p.startswith(("vllm:", "kvasir:"))
                          and p.endswith("metric names should not contain ':'"))
                  and p != ('vllm:iteration_tokens_total non-counter metrics should not have '
                            '"_total" suffix')]
    assert not unexpected, "\n".join(unexpected)
    assert run.returncode in (0, 3)  # 3: lint findings only (the colons above)


def test_every_vllm_name_is_exposed_with_model_name(server: LiveServer) -> None:
    text = server.get("/metrics").text
    for name in VLLM_NAMES:
        assert f"{name}{{" in text, name
    assert 'vllm:num_requests_running{engine="0",model_name="test"}' in text


def test_counters_move_by_the_right_amounts(server: LiveServer) -> None:
    server.wait_idle()
    before = server.metrics()
    client = server.client()
    prompts = ["Hello world!", "The quick brown fox jumps", "Paged attention"]
    max_tokens = [3, 5, 7]
    num_prompt = 0
    for prompt, n in zip(prompts, max_tokens, strict=True):
        r = client.completions.create(model="test", prompt=prompt, max_tokens=n,
                                      extra_body={"ignore_eos": True})
        num_prompt += r.usage.prompt_tokens
    server.wait_idle()
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == num_prompt
    assert delta("vllm:generation_tokens_total") == sum(max_tokens)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_prompt_tokens_sum") == num_prompt
    assert delta("vllm:request_generation_tokens_sum") == sum(max_tokens)
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert delta(f"{hist}_count") == 3, hist
    assert delta("vllm:inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    # Each request decodes one token per step after its prefill step.
    assert delta("kvasir:scheduled_tokens_per_step_sum") == num_prompt + sum(max_tokens) - 3
    assert delta("vllm:num_preemptions_total") == 0
    assert server.metric("vllm:num_requests_running") == 0


def test_every_outcome_is_counted_once_and_exists_from_the_start(tiny_model: Path) -> None:
    """vLLM creates each finished_reason series at zero and counts an aborted stream."""
    with live_server(tiny_config(tiny_model)) as live:
        for reason in ("stop", "length", "abort", "error"):
            assert ("vllm:request_success_total", (("finished_reason", reason),)) \
                in live.metrics(), reason
        body = {"model": "test", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", live.base_url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token is out: hang up mid-stream
        deadline = time.monotonic() + 30
        while (live.metric("vllm:request_success_total", finished_reason="abort") < 1
               and time.monotonic() < deadline):
            time.sleep(0.05)
        live.wait_idle()
        assert live.metric("vllm:request_success_total", finished_reason="abort") == 1
        assert live.metric("vllm:request_success_total", finished_reason="length") == 0
        assert live.metric("vllm:e2e_request_latency_seconds_count") == 1
        assert live.metric("vllm:request_generation_tokens_count") == 1
