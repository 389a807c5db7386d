"""Many clients at once, a third of them hanging up mid-stream: nothing breaks, nothing leaks."""

from __future__ import annotations

import asyncio
import json

import httpx
from harness import API_KEY, LiveServer

NUM_CLIENTS = 64
MAX_TOKENS = 24
# The clients that hang up ask for far more, so their requests cannot finish before the abort.
MAX_TOKENS_QUITTER = 200
PROMPTS = ["The quick brown fox", "Paged attention keeps", "Hello world!", "Continuous batching"]


async def _client(http: httpx.AsyncClient, base_url: str, index: int) -> dict[str, object]:
    quitter = index % 3 == 0
    body = {"model": "test", "prompt": PROMPTS[index % len(PROMPTS)], "temperature": 0,
            "max_tokens": MAX_TOKENS_QUITTER if quitter else MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    async with http.stream("POST", f"{base_url}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if quitter and len(events) == 3:
                break  # leaving the block closes the connection: the client is gone
    return {"quitter": quitter, "events": events}


def _check_intact(events: list[str]) -> None:
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == MAX_TOKENS
    body = chunks[:-1]
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in body)
    reasons = [c["choices"][0]["finish_reason"] for c in body]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_64_clients_a_third_disconnecting_leak_nothing(server: LiveServer) -> None:
    before = server.metrics()

    async def run() -> list[dict[str, object]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(_client(http, server.base_url, i)
                                          for i in range(NUM_CLIENTS)))

    results = asyncio.run(run())
    completed = [r for r in results if not r["quitter"]]
    assert len(completed) == NUM_CLIENTS - len(range(0, NUM_CLIENTS, 3))
    for r in completed:
        _check_intact(r["events"])  # type: ignore[arg-type]

    server.wait_idle()
    after = server.metrics()
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    finished_key = ("vllm:request_success_total", (("finished_reason", "length"),))
    assert after[finished_key] - before.get(finished_key, 0) == len(completed)
    # The hung-up requests were cut short: far fewer tokens than had they run to the end.
    gen_key = ("vllm:generation_tokens_total", ())
    generated = after[gen_key] - before.get(gen_key, 0)
    num_quitters = NUM_CLIENTS - len(completed)
    assert generated < len(completed) * MAX_TOKENS + num_quitters * MAX_TOKENS_QUITTER
    # And the server still serves.
    r = server.client().completions.create(model="test", prompt="Hello", max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_non_streaming_client_disconnect_aborts(server: LiveServer) -> None:
    before = server.metric("vllm:request_success_total", finished_reason="length")

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            task = asyncio.ensure_future(http.post(
                f"{server.base_url}/v1/completions",
                headers={"Authorization": f"Bearer {API_KEY}"},
                json={"model": "test", "prompt": "Hello", "max_tokens": 240,
                      "ignore_eos": True}))
            while not server.state.async_engine.engine_thread.has_work:
                await asyncio.sleep(0.01)
            task.cancel()

    asyncio.run(run())
    server.wait_idle()
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    assert server.metric("vllm:request_success_total", finished_reason="length") == before
