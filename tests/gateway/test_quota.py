"""The quota stores' decisions: the in-process store and the Redis store (a real redis-server)
take the same ones; two Redis stores share one budget; an unreachable Redis fails open or
closed at once, as configured."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from gateway_support import free_port
from kvasir_gateway.config import QuotaLimits
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.quota import MemoryQuotaStore, QuotaStore, duration_text, window_state
from kvasir_gateway.redis_quota import RedisQuotaStore


@pytest_asyncio.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    if request.param == "memory":
        s: QuotaStore = MemoryQuotaStore()
    else:
        s = RedisQuotaStore(request.getfixturevalue("redis_url"), GatewayMetrics())
    yield s
    await s.close()


@pytest.mark.asyncio
async def test_tokens_per_minute_reserve_settle_refuse(store: QuotaStore) -> None:
    limits = QuotaLimits(tokens_per_minute=1000)
    first = await store.admit("t", limits, 600, "a")
    assert first.allowed and first.tokens_remaining == 400
    refused = await store.admit("t", limits, 600, "b")
    assert not refused.allowed and refused.refused_by == "tokens"
    # sliding window: the 600 admitted this second must leave it first, 60-61 s from now
    assert 59 <= refused.retry_after_seconds <= 61
    headers = refused.headers()
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "400"
    assert headers["retry-after"] in {"60", "61"}
    assert 59 <= refused.tokens_reset_seconds <= 61  # when the whole window has emptied
    assert headers["x-ratelimit-reset-tokens"][-1] == "s"
    # the response used only 100 of the 600 reserved: 500 come back
    await store.settle("t", limits, 100 - 600, "a", first.window_second)
    again = await store.admit("t", limits, 600, "c")
    assert again.allowed and again.tokens_remaining == 300
    # another tenant has its own bucket
    assert (await store.admit("u", limits, 1000, "d")).allowed


@pytest.mark.asyncio
async def test_no_minute_admits_more_than_the_quota_even_from_fresh(store: QuotaStore) -> None:
    """A fresh tenant may spend its minute at once, and then nothing more for that minute
    (a full token bucket would admit the quota again as it refills)."""
    limits = QuotaLimits(tokens_per_minute=1000)
    admitted = 0
    for i in range(30):
        result = await store.admit("t", limits, 90, f"r{i}")
        admitted += 90 * result.allowed
        await asyncio.sleep(0.02)
    assert admitted == 990  # 11 of 90: within the minute, never above 1000


@pytest.mark.asyncio
async def test_reservation_larger_than_the_limit_is_refused_without_retry(store: QuotaStore) -> None:
    result = await store.admit("t", QuotaLimits(tokens_per_minute=100), 101, "a")
    assert not result.allowed and result.refused_by == "too_large"
    assert "retry-after" not in result.headers()


@pytest.mark.asyncio
async def test_usage_above_the_reservation_is_a_debt(store: QuotaStore) -> None:
    limits = QuotaLimits(tokens_per_minute=1000)
    first = await store.admit("t", limits, 100, "a")
    await store.settle("t", limits, 1500 - 100, "a", first.window_second)  # used 1500
    result = await store.admit("t", limits, 1, "b")
    assert not result.allowed and result.refused_by == "tokens"
    assert result.retry_after_seconds > 55  # the 1500 leave the window only after a minute


@pytest.mark.asyncio
async def test_requests_per_minute(store: QuotaStore) -> None:
    limits = QuotaLimits(requests_per_minute=2)
    assert (await store.admit("t", limits, 5, "a")).allowed
    assert (await store.admit("t", limits, 5, "b")).allowed
    refused = await store.admit("t", limits, 5, "c")
    assert not refused.allowed and refused.refused_by == "requests"
    assert refused.headers()["x-ratelimit-remaining-requests"] == "0"
    assert 59 <= refused.retry_after_seconds <= 61


@pytest.mark.asyncio
async def test_max_concurrent_counts_open_leases(store: QuotaStore) -> None:
    limits = QuotaLimits(max_concurrent=2)
    assert (await store.admit("t", limits, 1, "a")).allowed
    assert (await store.admit("t", limits, 1, "b")).allowed
    refused = await store.admit("t", limits, 1, "c")
    assert not refused.allowed and refused.refused_by == "concurrent"
    await store.settle("t", limits, 0, "a", 0)
    assert (await store.admit("t", limits, 1, "c")).allowed


@pytest.mark.asyncio
async def test_a_crashed_gateways_lease_expires(redis_url: str) -> None:
    store = RedisQuotaStore(redis_url, GatewayMetrics(), lease_seconds=0.3)
    limits = QuotaLimits(max_concurrent=1)
    assert (await store.admit("t", limits, 1, "lost")).allowed  # never settled
    assert not (await store.admit("t", limits, 1, "b")).allowed
    await asyncio.sleep(0.4)
    assert (await store.admit("t", limits, 1, "b")).allowed
    await store.close()


@pytest.mark.asyncio
async def test_renewed_leases_outlive_their_first_expiry(store: QuotaStore) -> None:
    store.lease_seconds = 0.3  # type: ignore[attr-defined]
    if isinstance(store, RedisQuotaStore):
        store.lease_ms = 300
    limits = QuotaLimits(max_concurrent=1)
    assert (await store.admit("t", limits, 1, "long")).allowed
    for _ in range(3):
        await asyncio.sleep(0.15)
        await store.renew({"t": ["long"]})
    assert not (await store.admit("t", limits, 1, "b")).allowed  # still held at 0.45 s
    await store.settle("t", limits, 0, "long", 0)
    await store.renew({"t": ["long"]})  # a settled lease is not brought back
    assert (await store.admit("t", limits, 1, "b")).allowed


@pytest.mark.asyncio
async def test_two_redis_stores_share_one_budget(redis_url: str) -> None:
    a, b = (RedisQuotaStore(redis_url, GatewayMetrics()) for _ in range(2))
    limits = QuotaLimits(tokens_per_minute=1000, max_concurrent=3)
    results = await asyncio.gather(*(s.admit("t", limits, 100, f"r{i}")
                                     for i, s in enumerate([a, b] * 10)))
    assert sum(r.allowed for r in results) == 3  # the concurrency bound, across both
    assert {r.refused_by for r in results if not r.allowed} == {"concurrent"}
    await asyncio.gather(*(s.settle("t", limits, 0, f"r{i}", 0)
                           for i, s in enumerate([a, b] * 10)))
    results = await asyncio.gather(*(s.admit("t", limits, 100, f"s{i}")
                                     for i, s in enumerate([a, b, a, b, a, b, a, b])))
    # 300 already reserved, 700 left: 3 of 8 before concurrency; then tokens decide
    allowed = [r for r in results if r.allowed]
    assert len(allowed) == 3
    assert min(r.tokens_remaining for r in allowed) == 400
    await a.close()
    await b.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("fail_open", [True, False])
async def test_unreachable_redis_answers_at_once(fail_open: bool,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    metrics = GatewayMetrics()
    store = RedisQuotaStore(f"redis://127.0.0.1:{free_port()}/0", metrics,
                            timeout_seconds=0.2, fail_open=fail_open)
    started = time.monotonic()
    result = await store.admit("t", QuotaLimits(tokens_per_minute=10), 5, "a")
    await store.settle("t", QuotaLimits(tokens_per_minute=10), 0, "a", 0)
    assert time.monotonic() - started < 1.5
    assert result.allowed is fail_open and not result.enforced
    assert result.refused_by == (None if fail_open else "store")
    assert result.headers() == ({} if fail_open else {"retry-after": "1"})
    action = "fail_open" if fail_open else "fail_closed"
    assert metrics.quota_store_errors.labels(action)._value.get() == 1
    assert metrics.quota_store_errors.labels("settle")._value.get() == 1
    said = "fail-open" if fail_open else "fail-closed"
    assert [r.levelname for r in caplog.records if said in r.getMessage()] == ["WARNING"]
    await store.close()


def test_duration_text_follows_openais_format() -> None:
    assert duration_text(0.02) == "20ms"
    assert duration_text(1.5) == "1.5s"
    assert duration_text(360) == "6m0s"


def test_a_span_straddling_whole_seconds_stays_within_the_quota() -> None:
    """Admitted late in second 100 (at 100.9), the tokens still count 59.6 s later (at 160.5,
    in second 160): a window that dropped second 100 at 160 would admit the quota again inside
    one 60-second span. They leave the window at second 161."""
    per_second = {100: 1000}
    inside = window_state(dict(per_second), cap=1000, cost=1, now=160.5)
    assert inside.used == 1000
    assert inside.wait_seconds == pytest.approx(0.5)
    after = window_state(dict(per_second), cap=1000, cost=1, now=161.0)
    assert after.used == 0 and after.wait_seconds == 0


@pytest.mark.asyncio
async def test_the_redis_window_keeps_the_same_seconds(redis_url: str) -> None:
    """The Lua twin of `window_state` keeps a second for as long: a counter written 60 s before
    Redis's clock still counts, one written 61 s before does not."""
    store = RedisQuotaStore(redis_url, GatewayMetrics())
    try:
        tokens_key = "kvasir:quota:{edge}:tokens"
        now_s = int((await store.client.time())[0])
        await store.client.hset(tokens_key, mapping={str(now_s - 60): 700, str(now_s - 61): 300})
        result = await store.admit("edge", QuotaLimits(tokens_per_minute=1000), 300, "a")
        assert result.allowed and result.tokens_remaining == 0  # 700 kept + 300 admitted
    finally:
        await store.client.delete("kvasir:quota:{edge}:tokens", "kvasir:quota:{edge}:requests")
        await store.close()
