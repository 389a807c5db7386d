"""The gateway in front of a real Kvasir engine server (tiny random checkpoint, 127.0.0.1): the
engine trusts the gateway's key, takes the tenant from x-kvasir-tenant, and counts the request
under that tenant; streams and usage pass through; the token budget is settled from the
engine's own usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")
from gateway_support import KEYS, gateway, post  # noqa: E402
from harness import LiveServer, live_server, tiny_config  # noqa: E402
from helpers import write_checkpoint  # noqa: E402
from kvasir_gateway.config import QuotaLimits  # noqa: E402

GATEWAY_KEY = "gw-trusted-secret"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = write_checkpoint(tmp_path_factory.mktemp("tiny-llama-gw"), "llama")
    with live_server(tiny_config(model), api_keys=("direct:sk-direct",),
                     trusted_gateway_keys=(f"gateway:{GATEWAY_KEY}",)) as live:
        yield live


def test_proxy_to_a_real_engine_with_the_tenant(engine: LiveServer, key_file: Path) -> None:
    with gateway(backends=(engine.base_url,), api_key_file=str(key_file),
                 upstream_key=GATEWAY_KEY,
                 tenant_limits={"alice": QuotaLimits(tokens_per_minute=10_000)}) as gw:
        auth = {"authorization": f"Bearer {KEYS['alice']}"}
        models = httpx.get(gw.url + "/v1/models", headers=auth, timeout=10).json()["data"]
        model = models[0]["id"]
        body = {"model": model, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
        resp = post(gw.url, "/v1/completions", body, key=KEYS["alice"], timeout=60)
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert usage["completion_tokens"] == 4
        assert resp.headers["x-ratelimit-limit-tokens"] == "10000"
        with httpx.stream("POST", gw.url + "/v1/completions", headers=auth, timeout=60,
                          json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any(c.get("usage") for c in chunks)  # asked upstream, stripped here
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == resp.json()["choices"][0]["text"]  # greedy: the same 4 tokens
        # bob's request too; the engine counted each under the tenant the gateway named
        assert post(gw.url, "/v1/completions", body, key=KEYS["bob"], timeout=60).status_code == 200
        page = engine.get("/metrics").text
        alice = [line for line in page.splitlines()
                 if line.startswith("kvasir:tenant_requests") and 'tenant="alice"' in line]
        assert alice and float(alice[0].rsplit(" ", 1)[1]) == 2.0
        assert any('tenant="bob"' in line for line in page.splitlines())
        # a client cannot name a tenant to the engine itself without the gateway's key
        direct = httpx.post(engine.base_url + "/v1/completions", json=body, timeout=30,
                            headers={"authorization": "Bearer sk-direct",
                                     "x-kvasir-tenant": "alice"})
        assert direct.status_code == 403
