"""The gateway's view of a real engine's prefix cache: the held hashes (/kvasir/prefix-cache) and
a prompt's hashes (/kvasir/prefix-hashes/...) agree, are salted per tenant, answer only the
trusted gateway, and refuse bad parameters with a 400 naming them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import LiveServer, live_server, tiny_config
from helpers import write_checkpoint

GATEWAY_KEY = "gw-prefix-secret"
TENANT_KEY = "sk-prefix-tenant"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama-prefix"), "llama")


@pytest.fixture(scope="module")
def live(model: Path) -> Iterator[LiveServer]:
    with live_server(tiny_config(model, prefix_caching=True), api_keys=(f"team:{TENANT_KEY}",),
                     trusted_gateway_keys=(f"gateway:{GATEWAY_KEY}",)) as server:
        yield server


def _as_gateway(live: LiveServer, method: str, path: str, tenant: str = "alice",
                **kwargs: Any) -> httpx.Response:
    return httpx.request(method, live.base_url + path, timeout=60, headers={
        "authorization": f"Bearer {GATEWAY_KEY}", "x-kvasir-tenant": tenant}, **kwargs)


PROMPT = list(range(20, 60))  # 40 tokens: 10 full blocks of 4


def test_held_hashes_hold_the_prompt_hashes_of_the_tenant_that_sent_it(live: LiveServer) -> None:
    body = {"model": "test", "prompt": PROMPT, "max_tokens": 1}
    hashes = _as_gateway(live, "POST", "/kvasir/prefix-hashes/completions", json=body).json()
    assert hashes["block_size"] == 4 and hashes["num_tokens"] == 40
    assert len(hashes["block_hashes"]) == 10
    before = _as_gateway(live, "GET", "/kvasir/prefix-cache").json()
    assert before["reset"] and not set(hashes["block_hashes"]) & set(before["stored"])
    assert _as_gateway(live, "POST", "/v1/completions", json=body).status_code == 200
    live.wait_idle()
    after = _as_gateway(live, "GET", "/kvasir/prefix-cache",
                        params={"instance": before["instance"], "since": before["seq"]}).json()
    assert not after["reset"] and after["seq"] > before["seq"]
    assert set(hashes["block_hashes"]) <= set(after["stored"])
    # another tenant's identical prompt hashes elsewhere: nothing it could match
    bob = _as_gateway(live, "POST", "/kvasir/prefix-hashes/completions", tenant="bob",
                      json=body).json()["block_hashes"]
    assert not set(bob) & set(after["stored"])
    few = _as_gateway(live, "POST", "/kvasir/prefix-hashes/completions",
                      params={"max_blocks": 3}, json=body).json()["block_hashes"]
    assert few == hashes["block_hashes"][:3]


def test_chat_hashes_follow_the_chat_template(live: LiveServer) -> None:
    messages = [{"role": "system", "content": "you are terse " * 8},
                {"role": "user", "content": "hi"}]
    chat = _as_gateway(live, "POST", "/kvasir/prefix-hashes/chat/completions",
                       json={"model": "test", "messages": messages}).json()
    tokens = _as_gateway(live, "POST", "/tokenize",
                         json={"model": "test", "messages": messages}).json()["tokens"]
    assert chat["num_tokens"] == len(tokens) and len(chat["block_hashes"]) == len(tokens) // 4


def test_only_the_gateway_may_read_and_bad_parameters_are_400(live: LiveServer) -> None:
    tenant = httpx.get(live.base_url + "/kvasir/prefix-cache", timeout=10,
                       headers={"authorization": f"Bearer {TENANT_KEY}"})
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "gateway_only"
    assert httpx.get(live.base_url + "/kvasir/prefix-cache", timeout=10).status_code == 401
    for params, name in (({"since": "x"}, "since"), ({"since": "-1"}, "since")):
        resp = _as_gateway(live, "GET", "/kvasir/prefix-cache", params=params)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == name
    body = {"model": "test", "prompt": PROMPT}
    for value in ("0", "1025", "many"):
        resp = _as_gateway(live, "POST", "/kvasir/prefix-hashes/completions",
                           params={"max_blocks": value}, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_blocks"
    resp = _as_gateway(live, "POST", "/kvasir/prefix-hashes/completions",
                       json={**body, "model": "nope"})
    assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == "model"
    resp = _as_gateway(live, "POST", "/kvasir/prefix-hashes/completions", json={"model": "test"})
    assert resp.status_code == 400


def test_without_prefix_caching_the_routes_are_404(model: Path) -> None:
    with live_server(dataclasses.replace(tiny_config(model)), api_keys=()) as server:
        resp = server.get("/kvasir/prefix-cache")
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "prefix_caching_disabled"
