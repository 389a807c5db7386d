"""Honest probes and the queue limit: a frozen engine fails /health and /ready, a busy one stays
ready, a full queue answers 429 with Retry-After."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest
from harness import LiveServer, live_server, tiny_config


def _poll(server: LiveServer, path: str, status: int, deadline_seconds: float) -> bool:
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        if server.get(path).status_code == status:
            return True
        time.sleep(0.1)
    return False


def test_frozen_step_fails_health_within_its_bound_and_ready(server: LiveServer) -> None:
    engine = server.state.async_engine
    results: list[object] = []
    engine.engine_thread.step_gate.clear()
    try:
        worker = threading.Thread(target=lambda: results.append(
            server.client().completions.create(model="test", prompt="Hello", max_tokens=4,
                                               extra_body={"ignore_eos": True})))
        worker.start()
        while not engine.engine_thread.has_work:
            time.sleep(0.01)
        # health_stall_seconds is 1.0 for this server; allow generous scheduling slack.
        assert _poll(server, "/health", 503, deadline_seconds=10.0)
        body = server.get("/health").json()
        assert body["status"] == "unhealthy" and "no engine step" in body["reason"]
        assert server.get("/ready").status_code == 503
    finally:
        engine.engine_thread.step_gate.set()
    worker.join(timeout=60)
    assert results and results[0].usage.completion_tokens == 4  # type: ignore[attr-defined]
    assert server.get("/health").status_code == 200
    assert server.get("/ready").status_code == 200


def test_idle_ready_probe_runs_a_real_generation(server: LiveServer) -> None:
    server.wait_idle()
    engine = server.state.async_engine
    # Past the window in which recent progress answers by itself (1 s for this server).
    while time.monotonic() - engine.engine_thread.last_token_step_at <= 1.0:
        time.sleep(0.05)
    token_steps = engine.engine_thread.token_step_count
    assert server.get("/ready").status_code == 200
    assert engine.engine_thread.token_step_count > token_steps
    server.wait_idle()
    # The probe's request stays out of user metrics and leaves nothing behind.
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0


def test_ready_stays_200_under_saturating_load(tiny_model: Path) -> None:
    with live_server(tiny_config(tiny_model, max_num_seqs=4), ready_timeout_seconds=5.0) as live:
        errors: list[BaseException] = []

        def user(i: int) -> None:
            try:
                live.client().completions.create(model="test", prompt=f"Hello {i}",
                                                 max_tokens=120, extra_body={"ignore_eos": True})
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        users = [threading.Thread(target=user, args=(i,)) for i in range(16)]
        for t in users:
            t.start()
        engine = live.state.async_engine
        while engine.engine_thread.num_waiting == 0 and any(t.is_alive() for t in users):
            time.sleep(0.01)
        statuses = []
        while any(t.is_alive() for t in users) and len(statuses) < 10:
            statuses.append(live.get("/ready").status_code)
            assert live.get("/health").status_code == 200
        for t in users:
            t.join(timeout=120)
        assert not errors
        assert statuses and set(statuses) == {200}


def test_full_queue_is_429_with_retry_after(tiny_model: Path) -> None:
    with live_server(tiny_config(tiny_model, max_queue_len=2, max_num_seqs=1)) as live:
        engine = live.state.async_engine
        engine.engine_thread.step_gate.clear()
        try:
            refused = None
            for i in range(6):
                try:
                    resp = live.post("/v1/completions", timeout=1.0, json={
                        "model": "test", "prompt": f"Hi {i}", "max_tokens": 2})
                except Exception:  # noqa: BLE001 - admitted: it waits on the frozen engine
                    continue
                if resp.status_code == 429:
                    refused = resp
                    break
            assert refused is not None, "the queue limit never refused a request"
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                live.client().completions.create(model="test", prompt="x", max_tokens=2)
        finally:
            engine.engine_thread.step_gate.set()
        live.wait_idle()
        r = live.client().completions.create(model="test", prompt="x", max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "stop")


def test_busy_ready_answers_from_progress_already_made(server: LiveServer) -> None:
    """/ready never waits for a step when tokens were produced recently; a frozen engine fails
    once that progress is older than the window (1 s here) and the probe's timeout passes."""
    engine = server.state.async_engine
    server.client().completions.create(model="test", prompt="Hello", max_tokens=2)
    engine.engine_thread.step_gate.clear()
    worker = threading.Thread(target=lambda: server.client().completions.create(
        model="test", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}))
    try:
        worker.start()
        while not engine.engine_thread.has_work:
            time.sleep(0.01)
        steps = engine.engine_thread.step_count
        if time.monotonic() - engine.engine_thread.last_token_step_at < 1.0:
            # Answered while the engine is frozen: from the last token step, not a new one.
            assert server.get("/ready").status_code == 200
            assert engine.engine_thread.step_count == steps
        while time.monotonic() - engine.engine_thread.last_token_step_at <= 1.0:
            time.sleep(0.05)
        resp = server.get("/ready")
        assert resp.status_code == 503
        assert "no token-producing engine step" in resp.json()["error"]["message"]
        assert engine.engine_thread.step_count == steps
    finally:
        engine.engine_thread.step_gate.set()
        worker.join(timeout=60)
    assert server.get("/ready").status_code == 200
