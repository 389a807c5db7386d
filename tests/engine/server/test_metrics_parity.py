"""vLLM's dashboards read a Kvasir server unchanged (issue 42): docs/metrics.md against /metrics.

A real engine on 127.0.0.1 (prefix caching on) takes a bounded mixed load: completions and chat,
streaming and not, n=2, prompts that share a prefix, a greedy request stopped by a stop string,
a stream the client cancels after its first token, and a request the engine fails on its own
data (fault injection in the runner's batch preparation, as test_engine_failures.py). Then every
row of docs/metrics.md's tables is exported with its type and labels, the series it promises
exist (those "from the start" before any request), each outcome is counted exactly once, the
per-request histograms observe what vLLM's do, and promtool finds nothing but vLLM's own names.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import API_KEY, LiveServer, live_server, tiny_config
from metrics_table import (
    FROM_THE_START,
    OPTIONAL_SERIES,
    PER_HANDLER,
    PER_TENANT,
    documented_metrics,
    exported_families,
    problems,
)

# The runner fails any batch holding a request whose prompt starts so (its own data).
POISON_PROMPT = [7, 8, 9]
SHARED_PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # three blocks of 4
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def live(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(tiny_config(tiny_model, prefix_caching=True)) as server:
        runner = server.state.async_engine.engine_thread.engine.core.executor.runner  # type: ignore[attr-defined]
        real_prepare = runner._prepare  # noqa: SLF001

        def prepare(so):  # type: ignore[no-untyped-def]
            if any(runner.states[r].token_ids[:3] == POISON_PROMPT
                   for r in so.num_scheduled_tokens):
                raise ValueError("Overflow when unpacking long long")
            return real_prepare(so)

        runner._prepare = prepare  # noqa: SLF001
        yield server


def post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, headers=HEADERS, timeout=120)


def stream(live: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every SSE chunk of a streamed answer."""
    chunks = []
    with httpx.stream("POST", live.base_url + path, json={**body, "stream": True},
                      headers=HEADERS, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def cancel_after_first_token(live: LiveServer) -> None:
    body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.base_url + "/v1/completions", json=body, headers=HEADERS,
                      timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # the first token is out: hang up mid-stream


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_every_documented_metric_is_exported_and_every_outcome_counted_once(
        live: LiveServer) -> None:
    rows = documented_metrics()
    always = [row for row in rows if row.series not in OPTIONAL_SERIES]
    live.wait_idle()
    fresh = live.get("/metrics").text
    assert not problems(fresh, always, need_series={FROM_THE_START})
    # Speculative decoding and KV transfer are off here: their families do not exist (vLLM's
    # spec-decode ones neither).
    families = exported_families(fresh)
    assert not [row.name for row in rows
                if row.series in OPTIONAL_SERIES and row.family in families]
    before = live.metrics()

    # A greedy request alone, then the same one stopped by a stop string in its text.
    greedy = {"prompt": [5, 6, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    text = post(live, "/v1/completions", greedy).json()["choices"][0]["text"]
    assert text, "the tiny model's greedy answer decodes to no text"
    stopped = post(live, "/v1/completions", {**greedy, "stop": [text[0]]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"

    # Then everything at once.
    calls: list[Callable[[], Any]] = [
        lambda: post(live, "/v1/completions", {"prompt": SHARED_PREFIX + [30, 31], "n": 2,
                                               "max_tokens": 5, "ignore_eos": True}),
        lambda: stream(live, "/v1/completions", {
            "prompt": SHARED_PREFIX + [32], "max_tokens": 6, "ignore_eos": True,
            "stream_options": {"include_usage": True}}),
        lambda: post(live, "/v1/completions", {"prompt": [SHARED_PREFIX + [33],
                                                          SHARED_PREFIX + [34, 35]],
                                               "max_tokens": 4, "ignore_eos": True}),
        lambda: post(live, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4,
            "ignore_eos": True}),
        lambda: stream(live, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello again"}], "n": 2, "max_tokens": 5,
            "ignore_eos": True}),
        lambda: cancel_after_first_token(live),
    ]
    results: dict[str, Any] = {}

    def run(name: str, call: Callable[[], Any]) -> None:
        try:
            results[name] = call()
        except Exception as e:  # noqa: BLE001 - asserted below, on the test's thread
            results[name] = e

    threads = [threading.Thread(target=run, args=(str(i), call)) for i, call in enumerate(calls)]
    threads.append(threading.Thread(target=run, args=("poisoned", lambda: post(
        live, "/v1/completions", {"prompt": POISON_PROMPT, "max_tokens": 4}))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not [r for r in results.values() if isinstance(r, Exception)], results
    assert results["poisoned"].status_code == 500
    assert results["poisoned"].json()["error"]["code"] == "request_failed"
    for name in ("0", "2", "3"):
        assert results[name].status_code == 200, results[name].text
    wait_for(lambda: live.metric("vllm:request_success_total", finished_reason="abort")
             - before.get(("vllm:request_success_total", (("finished_reason", "abort"),)), 0)
             >= 1, "the cancelled stream was never counted")
    live.wait_idle()
    page = live.get("/metrics").text
    after = live.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Every row exported with its type and labels; everything the load touched has series.
    assert not problems(page, always, need_series={FROM_THE_START, PER_HANDLER, PER_TENANT})

    # Each outcome exactly once. length: greedy 1, n=2 2, stream 1, two prompts 2, chat 1,
    # chat n=2 2; stop: 1; abort: the cancelled stream; error: the poisoned request.
    outcomes = {"length": 9, "stop": 1, "abort": 1, "error": 1}
    for reason, num in outcomes.items():
        assert delta("vllm:request_success_total", finished_reason=reason) == num, reason
    num_finished = sum(outcomes.values())
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
                 "vllm:request_queue_time_seconds"):
        assert delta(f"{name}_count") == num_finished, name
    # All but the poisoned request got a first token (the cancelled stream too).
    for name in ("vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds",
                 "vllm:request_prefill_kv_computed_tokens"):
        assert delta(f"{name}_count") == num_finished - 1, name
    # One parent per prompt of a call: greedy, stopped, n=2, stream, two prompts, chat, chat
    # n=2, cancelled, poisoned; n sums to the requests.
    assert delta("vllm:request_params_n_count") == 10
    assert delta("vllm:request_params_n_sum") == num_finished
    assert delta("vllm:request_max_num_generation_tokens_count") == 10

    # The prompt-token accounting adds up, and the shared prefix was served from the cache.
    cached = delta("vllm:prompt_tokens_cached_total")
    recomputed = delta("vllm:prompt_tokens_recomputed_total")
    assert cached > 0 and cached == delta("vllm:prompt_tokens_cached_by_source_total",
                                          source="device")
    assert delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == (
        cached + recomputed)
    assert (delta("vllm:prompt_tokens_by_source_total", source="local_compute")
            + delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit")
            == delta("vllm:prompt_tokens_total") + recomputed)
    assert delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert delta("vllm:iteration_tokens_total_count") > 0

    # HTTP: the poisoned call is the one 5xx; probes and the scrape are not counted.
    assert delta("http_requests_total", handler="/v1/completions", method="POST",
                 status="5xx") == 1
    assert delta("http_requests_total", handler="/v1/chat/completions", method="POST",
                 status="2xx") == 2
    assert not any(name == "http_requests_total" and ("handler", "/metrics") in labels
                   for name, labels in after)
    assert after[("vllm:engine_sleep_state", (("sleep_state", "awake"),))] == 1
    assert "_created" not in page

    promtool = shutil.which("promtool")
    if promtool is not None:
        run_ = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True,
                              text=True, timeout=60)
        findings = [line for line in (run_.stdout + run_.stderr).splitlines() if line.strip()]
        # vLLM's own names: the colon, and a histogram named "_total".
        unexpected = [f for f in findings
                      if not f.endswith("metric names should not contain ':'")
                      and not f.startswith("vllm:iteration_tokens_total non-counter")]
        assert not unexpected, "\n".join(unexpected)
