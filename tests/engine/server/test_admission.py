"""Admission counted in sequences (prompts x n): 400 for what can never be admitted, 429 with
Retry-After only for what can be later, and requests about to start are not counted as waiting.

Issue 14, defects 2 and 3, against a real server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness import API_KEY, LiveServer, live_server, tiny_config

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _completion(live: LiveServer, **body: object) -> httpx.Response:
    return live.post("/v1/completions", timeout=60,
                     json={"model": "test", "prompt": "Hi", "max_tokens": 2, **body})


def test_small_body_with_huge_fan_out_is_400_naming_the_limit(tiny_model: Path) -> None:
    # 500 prompts x n=16 in about 3.5 KB: 8000 sequences, refused at once (not queued).
    with live_server(tiny_config(tiny_model)) as live:
        started = time.monotonic()
        resp = live.post("/v1/completions", timeout=30, json={
            "model": "test", "prompt": ["hi"] * 500, "n": 16, "max_tokens": 1})
        assert time.monotonic() - started < 10
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert "--max-request-sequences" in error["message"]
        assert "8000 sequences (500 prompts x n=16)" in error["message"]
        assert error["param"] == "prompt"
        assert live.state.async_engine.ledger.num_live == 0
        # Another client is served at once.
        assert _completion(live).status_code == 200


def test_default_queue_bound(tiny_model: Path) -> None:
    from kvasir_engine.server.admission import DEFAULT_QUEUE_LEN_PER_RUNNING_SLOT

    with live_server(tiny_config(tiny_model, max_num_seqs=3)) as live:
        limits = live.state.admission_limits
        assert limits.max_queue_len == DEFAULT_QUEUE_LEN_PER_RUNNING_SLOT * 3
        resp = _completion(live, n=16)  # 16 > 3 running + 12 waiting: never admissible
        assert resp.status_code == 400, resp.text
        assert "--max-queue-len" in resp.json()["error"]["message"]


def test_never_admissible_is_400_and_admissible_is_served(tiny_model: Path) -> None:
    with live_server(tiny_config(tiny_model, max_queue_len=4, max_num_seqs=2)) as live:
        resp = _completion(live, n=8)
        assert resp.status_code == 400, resp.text  # was 429 + Retry-After, forever
        assert "Retry-After" not in resp.headers
        error = resp.json()["error"]
        assert error["param"] == "n" and error["code"] == "too_many_sequences"
        assert "at most 6 can ever be admitted" in error["message"]
        assert "--max-queue-len" in error["message"]
        # 6 = 2 running + 4 waiting fits an idle server.
        resp = _completion(live, n=6)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == 6


async def _burst(live: LiveServer, count: int, refused_expected: int
                 ) -> list[httpx.Response]:
    """`count` concurrent requests against a frozen engine, arriving 50 ms apart (so the
    count cannot depend on how many the engine thread happens to take in one batch); the gate
    opens once the refusals have come back, so the admitted ones then finish."""
    engine = live.state.async_engine
    async with httpx.AsyncClient(base_url=live.base_url, headers=HEADERS, timeout=120) as client:
        tasks = []
        for i in range(count):
            tasks.append(asyncio.ensure_future(client.post("/v1/completions", json={
                "model": "test", "prompt": f"Hello {i}", "max_tokens": 4, "ignore_eos": True})))
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 30
        while sum(t.done() for t in tasks) < refused_expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # anything else that would come back does so now
        num_early = sum(t.done() for t in tasks)
        engine.engine_thread.step_gate.set()
        responses = list(await asyncio.gather(*tasks))
    assert num_early == refused_expected
    return responses


def test_requests_about_to_start_are_not_counted_as_waiting(tiny_model: Path) -> None:
    # 4 running slots + 4 waiting: 24 at once admit 8 (on main: 5), the other 16 get 429.
    with live_server(tiny_config(tiny_model, max_queue_len=4, max_num_seqs=4)) as live:
        live.state.async_engine.engine_thread.step_gate.clear()
        try:
            responses = asyncio.run(_burst(live, 24, refused_expected=16))
        finally:
            live.state.async_engine.engine_thread.step_gate.set()
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200] * 8 + [429] * 16
        refused = [r for r in responses if r.status_code == 429]
        assert all(r.headers["Retry-After"] == "1" for r in refused)
        assert all(r.json()["error"]["code"] == "queue_full" for r in refused)
        live.wait_idle()
        assert live.state.async_engine.ledger.num_live == 0
        # What was refused can be admitted later: the same request now succeeds.
        assert _completion(live).status_code == 200


def test_per_tenant_waiting_bound(tiny_model: Path, tmp_path: Path) -> None:
    keys = {"tenant-a": "sk-aaaa", "tenant-b": "sk-bbbb"}
    config = tiny_config(tiny_model, max_queue_len=16, max_num_seqs=2)
    with live_server(config, api_keys=tuple(f"{t}:{k}" for t, k in keys.items()),
                     max_waiting_seqs_per_tenant=1) as live:
        resp = live.post("/v1/completions", api_key=keys["tenant-a"], json={
            "model": "test", "prompt": "Hi", "n": 4, "max_tokens": 2})
        assert resp.status_code == 400, resp.text  # 4 > 2 running + 1 waiting, ever
        assert "--max-waiting-seqs-per-tenant" in resp.json()["error"]["message"]
        engine = live.state.async_engine
        engine.engine_thread.step_gate.clear()

        async def flood_and_other() -> tuple[list[int], int]:
            async with httpx.AsyncClient(base_url=live.base_url, timeout=120) as client:
                def send(key: str, i: int) -> asyncio.Future[httpx.Response]:
                    return asyncio.ensure_future(client.post(
                        "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": "test", "prompt": f"Hi {i}", "max_tokens": 2}))
                flood = [send(keys["tenant-a"], i) for i in range(5)]
                await asyncio.sleep(1.0)
                other = send(keys["tenant-b"], 99)
                await asyncio.sleep(0.5)
                early = [t.result().status_code for t in flood if t.done()]
                engine.engine_thread.step_gate.set()
                done = await asyncio.gather(*flood)
                assert sorted(early) == [429, 429]
                return [r.status_code for r in done], (await other).status_code

        try:
            flood_statuses, other_status = asyncio.run(flood_and_other())
        finally:
            engine.engine_thread.step_gate.set()
        # tenant-a: 2 running + 1 waiting admitted, 2 refused; tenant-b is not held back.
        assert sorted(flood_statuses) == [200, 200, 200, 429, 429]
        assert other_status == 200
        assert live.metric("kvasir:tenant_requests_refused_total", tenant="tenant-a") == 2
        assert live.metric("kvasir:tenant_requests_refused_total", tenant="tenant-b") == 0


@pytest.mark.parametrize("flag, value", [("--max-request-sequences", "0"),
                                         ("--max-waiting-seqs-per-tenant", "-1")])
def test_bad_limits_name_the_flag(flag: str, value: str) -> None:
    from kvasir_engine.main import build_parser
    from kvasir_engine.server.config import server_config_from_args

    with pytest.raises(ValueError, match=flag):
        server_config_from_args(build_parser().parse_args(["serve", flag, value]))


def test_admission_arithmetic() -> None:
    from kvasir_engine.core.limits import QueueFullError
    from kvasir_engine.server.admission import AdmissionLedger, AdmissionLimits

    limits = AdmissionLimits(max_num_seqs=4, max_queue_len=4, max_request_sequences=16,
                             max_waiting_seqs_per_tenant=2, max_running_seqs_per_tenant=3)
    assert limits.check_request(1, 5) is None  # 3 running + 2 waiting for one tenant
    message, param = limits.check_request(1, 6) or ("", "")
    assert "--max-waiting-seqs-per-tenant" in message and param == "n"
    message, param = limits.check_request(17, 1) or ("", "")
    assert "--max-request-sequences" in message and param == "prompt"
    ledger = AdmissionLedger(limits)
    ledger.check("a", 5)
    ledger.add("a", [f"a{i}" for i in range(5)])
    with pytest.raises(QueueFullError, match="tenant 'a'"):
        ledger.check("a", 1)
    ledger.check("b", 3)  # 8 admitted in all = 4 running + 4 waiting
    ledger.add("b", ["b0", "b1", "b2"])
    with pytest.raises(QueueFullError, match="--max-queue-len"):
        ledger.check("c", 1)
    ledger.remove("a0")
    ledger.remove("a0")  # idempotent: a finish and a release may both report it
    ledger.check("c", 1)
    assert ledger.num_live == 7 and ledger.num_of_tenant["a"] == 4


def test_key_lookup_compares_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from kvasir_engine.server.tenants import KeyRing, parse_key_entry

    ring = KeyRing([parse_key_entry(f"t{i}:key-{i}", "test", b"") for i in range(5)])
    calls = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert ring.tenant_for("key-0") == "t0"
    assert ring.tenant_for("nope") is None
    assert len(calls) == 10  # no early exit on a match


def test_salts_separate_tenants_and_combine_request_salts() -> None:
    from kvasir_engine.server.tenants import cache_salt_for

    groups = (frozenset({"pub-1", "pub-2"}),)
    a, b = cache_salt_for("a", groups, None), cache_salt_for("b", groups, None)
    assert a != b
    assert cache_salt_for("pub-1", groups, None) == cache_salt_for("pub-2", groups, None)
    assert cache_salt_for("a", groups, "x") not in (a, cache_salt_for("b", groups, "x"))
    # A request salt can never make one tenant's salt equal another's.
    assert cache_salt_for("a", groups, '"]') != cache_salt_for("a\"]", groups, None)


def test_fair_by_default_with_several_tenants() -> None:
    """No flag: one tenant of several may hold half of running + queue (issue 39, item 5: one
    key's large-n requests took all 320 slots and every other tenant got 429); alone, or
    anonymous, it keeps the whole queue."""
    from kvasir_engine.config import SchedulerConfig
    from kvasir_engine.server.admission import resolve_limits

    scheduler = SchedulerConfig(256, max_num_seqs=64)
    shared = resolve_limits(scheduler, max_request_sequences=512,
                            max_waiting_seqs_per_tenant=None, is_multi_tenant=True)
    assert shared.tenant_running_slots + (shared.max_waiting_seqs_per_tenant or 0) == 160
    assert shared.check_request(1, 161) is not None  # never admittable: 400
    assert shared.check_request(1, 160) is None
    alone = resolve_limits(scheduler, max_request_sequences=512,
                           max_waiting_seqs_per_tenant=None, is_multi_tenant=False)
    assert alone.max_waiting_seqs_per_tenant is None and alone.check_request(1, 320) is None
    explicit = resolve_limits(scheduler, max_request_sequences=512,
                              max_waiting_seqs_per_tenant=7, is_multi_tenant=True)
    assert explicit.max_waiting_seqs_per_tenant == 7


def test_one_key_cannot_fill_a_shared_server(tiny_model: Path) -> None:
    keys = {"tenant-a": "sk-aaaa", "tenant-b": "sk-bbbb"}
    config = tiny_config(tiny_model, max_queue_len=6, max_num_seqs=2)  # 8 admitted in all
    with live_server(config, api_keys=tuple(f"{t}:{k}" for t, k in keys.items())) as live:
        engine = live.state.async_engine
        engine.engine_thread.step_gate.clear()  # frozen: what is admitted stays admitted
        greedy: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: greedy.append(live.post(
            "/v1/completions", api_key=keys["tenant-a"],
            json={"model": "test", "prompt": ["Hi", "Ho"], "n": 2, "max_tokens": 2})))
        sender.start()
        deadline = time.monotonic() + 30
        while engine.ledger.num_of_tenant["tenant-a"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        more = live.post("/v1/completions", api_key=keys["tenant-a"], json={
            "model": "test", "prompt": "Hi", "max_tokens": 2})
        assert more.status_code == 429, more.text  # tenant-a holds its half (4 of 8)
        assert "--max-waiting-seqs-per-tenant" in more.json()["error"]["message"]
        engine.engine_thread.step_gate.set()
        other = live.post("/v1/completions", api_key=keys["tenant-b"], json={
            "model": "test", "prompt": "Hi", "max_tokens": 2})
        assert other.status_code == 200, other.text
        sender.join(timeout=60)
        assert greedy[0].status_code == 200, greedy[0].text
