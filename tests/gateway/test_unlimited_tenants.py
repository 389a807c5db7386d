"""A tenant without any limit never reaches the quota store: a real redis-server sees no
connection and no command for its requests, and a Redis that is hung or stopped neither delays
nor refuses them, even with `--redis-failure closed` (which still refuses the limited tenant)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from gateway_support import KEYS, FakeEngine, RedisServer, fake_engines, gateway, post
from kvasir_gateway.config import QuotaLimits

COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 5}
LIMITED = {"alice": QuotaLimits(tokens_per_minute=10_000)}  # bob has no limit at all


def served_twice(url: str, key: str) -> None:
    """One buffered and one streamed request, both answered in full."""
    assert post(url, "/v1/completions", COMPLETION, key=key).status_code == 200
    with httpx.stream("POST", url + "/v1/completions", timeout=10,
                      headers={"authorization": f"Bearer {key}"},
                      json={**COMPLETION, "stream": True}) as resp:
        assert resp.status_code == 200
        assert list(resp.iter_lines())[-2:] == ["data: [DONE]", ""]


def gateway_calls(probe: redis.Redis) -> tuple[int, set[str]]:
    """Connections and command names Redis received since the reset, the probe's own left out."""
    commands = {name.removeprefix("cmdstat_") for name in probe.info("commandstats")}
    return (int(probe.info("stats")["total_connections_received"]),
            commands - {"config|resetstat", "info"})


def test_the_store_is_never_asked_about_a_tenant_without_limits(
        redis_url: str, key_file: Path) -> None:
    probe = redis.Redis.from_url(redis_url)
    probe.config_resetstat()  # the probe's connection is open before: it counts none
    with fake_engines(FakeEngine()) as [engine], gateway(
            backends=(engine.url,), api_key_file=str(key_file), redis_url=redis_url,
            redis_fail_open=False, tenant_limits=LIMITED) as gw:
        served_twice(gw.url, KEYS["bob"])
        assert gateway_calls(probe) == (0, set())
        served_twice(gw.url, KEYS["alice"])  # the counter does see the gateway
        connections, commands = gateway_calls(probe)
        assert connections >= 1 and "evalsha" in commands


@pytest.fixture(params=["hung", "stopped"])
def broken_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A redis-server of its own, frozen with SIGSTOP (it accepts, never answers) or ended."""
    server = RedisServer(tmp_path)
    if request.param == "hung":
        os.kill(server.proc.pid, signal.SIGSTOP)
    else:
        server.stop()
    try:
        yield server.url
    finally:
        if request.param == "hung":
            os.kill(server.proc.pid, signal.SIGCONT)
            server.stop()


def test_redis_down_fails_closed_for_limited_tenants_only(broken_redis: str,
                                                          key_file: Path) -> None:
    with fake_engines(FakeEngine()) as [engine], gateway(
            backends=(engine.url,), api_key_file=str(key_file), redis_url=broken_redis,
            redis_fail_open=False, redis_timeout_seconds=0.2, tenant_limits=LIMITED) as gw:
        served_twice(gw.url, KEYS["bob"])
        refused = post(gw.url, "/v1/completions", COMPLETION, key=KEYS["alice"])
        assert refused.status_code == 503
        assert json.loads(refused.content)["error"]["code"] == "quota_store_unavailable"
        metrics = httpx.get(gw.url + "/metrics").text
        # alice's one admission failed; bob's two requests never asked (nor settled)
        assert 'kvasir_gateway_quota_store_errors_total{action="fail_closed"} 1.0' in metrics
        assert 'kvasir_gateway_quota_store_errors_total{action="settle"}' not in metrics
