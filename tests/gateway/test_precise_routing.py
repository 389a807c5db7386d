"""Precise prefix routing against two real engines on 127.0.0.1 (tiny random checkpoint, prefix
caching on): the gateway's mirror of each engine's held blocks follows the engine, requests
follow the blocks, a prefix the engine evicted stops attracting requests (where approximate
routing still believes it is there), and an engine that reports nothing is routed
approximately, counted."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
from gateway_support import KEYS, gateway, post, wait_until  # noqa: E402
from harness import LiveServer, live_server, tiny_config  # noqa: E402
from helpers import write_checkpoint  # noqa: E402
from kvasir_gateway.precise import HeldBlocks  # noqa: E402
from kvasir_gateway.replicas import Replica, apply_prefix_report  # noqa: E402
from kvasir_gateway.router import PrefixIndex  # noqa: E402

GATEWAY_KEY = "gw-precise-secret"
PROMPT = list(range(30, 90))  # 60 token ids: 15 blocks of 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama-precise"), "llama")


@pytest.fixture(scope="module")
def engines(model: Path) -> Iterator[list[LiveServer]]:
    config = tiny_config(model, prefix_caching=True, kv_bytes=1 << 20)
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(live_server(
            config, api_keys=(), trusted_gateway_keys=(f"gateway:{GATEWAY_KEY}",)))
            for _ in range(2)]


def _engine_post(engine: LiveServer, path: str, body: dict[str, Any],
                 tenant: str = "alice") -> httpx.Response:
    return httpx.post(engine.base_url + path, json=body, timeout=60, headers={
        "authorization": f"Bearer {GATEWAY_KEY}", "x-kvasir-tenant": tenant})


def _prompt_hashes(engine: LiveServer, prompt: list[int]) -> list[bytes]:
    answer = _engine_post(engine, "/kvasir/prefix-hashes/completions",
                          {"model": "test", "prompt": prompt}).json()
    return [bytes.fromhex(h) for h in answer["block_hashes"]]


def _decisions(served: Any, reason: str) -> float:
    registry = served.app.state.gateway.metrics.registry
    return registry.get_sample_value("kvasir_gateway_routing_decisions_total",
                                     {"reason": reason}) or 0.0


def _evict(engine: LiveServer, replica: Replica, first_block: bytes) -> None:
    """Other prompts sent to the engine itself, past the gateway, until its first block goes."""
    for seed in range(200):
        filler = [(seed * 7 + i) % 250 + 2 for i in range(200)]
        assert _engine_post(engine, "/v1/completions", {"model": "test", "prompt": filler,
                                                        "max_tokens": 1}).status_code == 200
        if first_block not in _held(engine):
            break
    wait_until(lambda: first_block not in replica.held_blocks, what="the eviction reported")


def _held(engine: LiveServer) -> set[bytes]:
    report = httpx.get(engine.base_url + "/kvasir/prefix-cache", timeout=10,
                       headers={"authorization": f"Bearer {GATEWAY_KEY}"}).json()
    return {bytes.fromhex(h) for h in report["stored"]}


def _complete(url: str, prompt: list[int]) -> None:
    resp = post(url, "/v1/completions", {"model": "test", "prompt": prompt, "max_tokens": 1},
                key=KEYS["alice"], timeout=60)
    assert resp.status_code == 200, resp.text


def test_precise_routing_follows_what_the_engines_hold(engines: list[LiveServer],
                                                       key_file: Path) -> None:
    with gateway(backends=tuple(e.base_url for e in engines), api_key_file=str(key_file),
                 upstream_key=GATEWAY_KEY, routing="precise", prefix_pending_seconds=0.0) as gw:
        g = gw.app.state.gateway
        hashes = _prompt_hashes(engines[0], PROMPT)
        assert len(hashes) == 15
        _complete(gw.url, PROMPT)
        by_url = g.replicas.replicas
        wait_until(lambda: any(set(hashes) <= r.held_blocks for r in by_url.values()),
                   what="the engine's report of the prompt's blocks")
        home_url = next(u for u, r in by_url.items() if set(hashes) <= r.held_blocks)
        home = next(e for e in engines if e.base_url == home_url)
        assert by_url[home_url].held_blocks == _held(home)  # the mirror is the engine's set
        before = _decisions(gw, "prefix")
        for i in range(3):
            _complete(gw.url, PROMPT + [200 + i] * 8)
        assert _decisions(gw, "prefix") == before + 3
        # evicted behind the gateway's back: the next request is no longer sent for it
        _evict(home, by_url[home_url], hashes[0])
        before = _decisions(gw, "prefix")
        _complete(gw.url, PROMPT)
        assert _decisions(gw, "prefix") == before
        fallbacks = g.metrics.registry.get_sample_value(
            "kvasir_gateway_precise_fallbacks_total", {"reason": "no_report"})
        assert not fallbacks


def test_approximate_routing_still_believes_in_an_evicted_prefix(engines: list[LiveServer],
                                                                 key_file: Path) -> None:
    prompt = [p + 100 for p in PROMPT]
    with gateway(backends=tuple(e.base_url for e in engines), api_key_file=str(key_file),
                 upstream_key=GATEWAY_KEY, routing="prefix") as gw:
        by_url = gw.app.state.gateway.replicas.replicas
        wait_until(lambda: len(gw.app.state.gateway.replicas.routable()) == 2, what="ready")
        _complete(gw.url, prompt)
        hashes = _prompt_hashes(engines[0], prompt)
        home = next(e for e in engines if set(hashes) <= _held(e))
        for i in range(2):  # the same prefix sticks to its replica, approximately too
            before = _decisions(gw, "prefix")
            _complete(gw.url, prompt + [210 + i] * 8)
            assert _decisions(gw, "prefix") == before + 1
        assert set(hashes) <= _held(home)
        replica = by_url[home.base_url]
        for seed in range(200):  # evicted past the gateway
            filler = [(seed * 11 + i) % 250 + 2 for i in range(200)]
            _engine_post(home, "/v1/completions", {"model": "test", "prompt": filler,
                                                   "max_tokens": 1})
            if hashes[0] not in _held(home):
                break
        assert hashes[0] not in _held(home) and not replica.held_blocks  # not polled here
        before = _decisions(gw, "prefix")
        _complete(gw.url, prompt)
        assert _decisions(gw, "prefix") == before + 1  # a hit it believes in, and a miss


def test_an_engine_without_reports_is_routed_approximately(model: Path,
                                                           key_file: Path) -> None:
    with live_server(tiny_config(model), api_keys=(),
                     trusted_gateway_keys=(f"gateway:{GATEWAY_KEY}",)) as engine, gateway(
            backends=(engine.base_url,), api_key_file=str(key_file), upstream_key=GATEWAY_KEY,
            routing="precise") as gw:
        _complete(gw.url, PROMPT)
        registry = gw.app.state.gateway.metrics.registry
        assert registry.get_sample_value("kvasir_gateway_precise_fallbacks_total",
                                         {"reason": "no_report"}) == 1.0


def test_a_hashing_call_past_its_deadline_is_routed_approximately(
        engines: list[LiveServer], key_file: Path) -> None:
    with gateway(backends=tuple(e.base_url for e in engines), api_key_file=str(key_file),
                 upstream_key=GATEWAY_KEY, routing="precise",
                 prefix_hash_timeout_seconds=1e-6) as gw:
        g = gw.app.state.gateway
        wait_until(lambda: all(r.prefix_cache_instance for r in g.replicas.replicas.values()),
                   what="the first reports")
        _complete(gw.url, PROMPT)
        assert g.metrics.registry.get_sample_value(
            "kvasir_gateway_precise_fallbacks_total", {"reason": "timeout"}) == 1.0


def test_held_blocks_score_reports_and_recent_sendings() -> None:
    a, b = Replica("http://a", is_ready=True), Replica("http://b", is_ready=True)
    apply_prefix_report(a, {"instance": "i", "seq": 3, "reset": True,
                            "stored": ["01", "02", "03"]})
    apply_prefix_report(a, {"instance": "i", "seq": 4, "reset": False, "stored": [],
                            "removed": ["03"]})
    assert a.held_blocks == {b"\x01", b"\x02"} and a.prefix_cache_seq == 4
    pending = PrefixIndex(100, horizon_seconds=60.0)
    chain = [b"\x01", b"\x02", b"\x03", b"\x04"]
    scorer = HeldBlocks([a, b], pending)
    assert (scorer.matched_blocks(chain, a.url), scorer.matched_blocks(chain, b.url)) == (2, 0)
    pending.record(chain[:3], b.url)  # sent to b, not reported yet: counts within the horizon
    assert scorer.matched_blocks(chain, b.url) == 3
    gone = PrefixIndex(100, horizon_seconds=0.0)
    gone.record(chain, b.url)
    assert HeldBlocks([a, b], gone).matched_blocks(chain, b.url) == 0
