"""Tenants by construction (issue 14, defect 1): API keys map to tenants, each tenant's prefix
cache is its own unless an operator shares it, a request's `cache_salt` narrows sharing further,
a trusted gateway may name the tenant, and per-tenant metrics have bounded label cardinality.

A real server on 127.0.0.1 with prefix caching on, over a tiny random model with room for the
issue's ~320-token prompt.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import API_KEY, LiveServer, live_server, tiny_config
from helpers import tiny_engine_config, write_checkpoint
from kvasir_engine.main import build_parser
from kvasir_engine.server.config import server_config_from_args

KEYS = {"tenant-a": "sk-tenant-a-0001", "tenant-b": "sk-tenant-b-0002",
        "pub-1": "sk-public-0003", "pub-2": "sk-public-0004"}
GATEWAY_KEY = "gw-secret-0005"
PROMPT_LEN = 320
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama-512"), "llama",
                            max_position_embeddings=512)


@pytest.fixture(scope="module")
def live(long_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    directory = tmp_path_factory.mktemp("keys")
    key_file = directory / "keys.txt"
    key_file.write_text("# tenant:key\n" + "".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    gateway_file = directory / "gateway.txt"
    gateway_file.write_text(GATEWAY_KEY + "\n")
    config = server_config_from_args(build_parser().parse_args([
        "serve", "--api-key-file", str(key_file), "--trusted-gateway-key-file",
        str(gateway_file), "--prefix-cache-shared-tenants", "pub-1,pub-2",
        "--max-tenant-metric-labels", "6"]))
    base = tiny_engine_config(long_model, max_model_len=512, block_size=BLOCK_SIZE,
                              kv_bytes=8 << 20)
    engine_config = dataclasses.replace(
        base, cache=dataclasses.replace(base.cache, enable_prefix_caching=True))
    overrides = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                 if f.name not in ("host", "port")}
    with live_server(engine_config, **overrides) as server:
        yield server


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 300) for _ in range(PROMPT_LEN)]


def _complete(live: LiveServer, key: str, prompt: list[int], *, headers: dict[str, str] | None = None,
              **extra: Any) -> httpx.Response:
    return httpx.post(f"{live.base_url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": "test", "prompt": prompt, "max_tokens": 1, **extra})


def _cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


# The last prompt token is always computed, so a full hit is the prompt less its last block.
FULL_HIT = PROMPT_LEN - BLOCK_SIZE


def test_another_tenant_gets_no_cached_tokens(live: LiveServer) -> None:
    prompt = _prompt(1)
    assert _cached(_complete(live, KEYS["tenant-a"], prompt)) == 0
    assert _cached(_complete(live, KEYS["tenant-a"], prompt)) >= FULL_HIT  # A gets its hits
    assert _cached(_complete(live, KEYS["tenant-b"], prompt)) == 0  # on main: 304
    # B's own copy is cached for B (isolation, not caching switched off).
    assert _cached(_complete(live, KEYS["tenant-b"], prompt)) >= FULL_HIT
    # The half-prefix guess (160 cached on main), by a tenant that never sent it.
    half = prompt[:PROMPT_LEN // 2] + _prompt(2)[:16]
    guesser = {"x-kvasir-tenant": "guesser"}
    assert _cached(_complete(live, GATEWAY_KEY, half, headers=guesser)) == 0


def test_cache_salt_separates_within_a_tenant(live: LiveServer) -> None:
    prompt, key = _prompt(3), KEYS["tenant-a"]
    assert _cached(_complete(live, key, prompt, cache_salt="s1")) == 0
    assert _cached(_complete(live, key, prompt, cache_salt="s1")) >= FULL_HIT
    assert _cached(_complete(live, key, prompt, cache_salt="s2")) == 0
    assert _cached(_complete(live, key, prompt)) == 0  # the salt adds to the tenant's
    # Another tenant using the same salt still shares nothing: the salt never replaces it.
    assert _cached(_complete(live, KEYS["tenant-b"], prompt, cache_salt="s1")) == 0
    resp = _complete(live, key, prompt, cache_salt="")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"


def test_cache_salt_on_chat(live: LiveServer) -> None:
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}]

    def chat(salt: str) -> int:
        resp = httpx.post(f"{live.base_url}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEYS['tenant-a']}"},
                          json={"model": "test", "messages": messages, "max_tokens": 1,
                                "cache_salt": salt})
        return _cached(resp)

    assert chat("chat-1") == 0
    assert chat("chat-1") > 0
    assert chat("chat-2") == 0


def test_shared_group_tenants_share(live: LiveServer) -> None:
    prompt = _prompt(4)
    assert _cached(_complete(live, KEYS["pub-1"], prompt)) == 0
    assert _cached(_complete(live, KEYS["pub-2"], prompt)) >= FULL_HIT
    assert _cached(_complete(live, KEYS["tenant-a"], prompt)) == 0  # outside the group


def test_gateway_names_the_tenant_and_nobody_else_may(live: LiveServer) -> None:
    prompt = _prompt(5)
    assert _cached(_complete(live, KEYS["tenant-a"], prompt)) == 0
    as_a = {"x-kvasir-tenant": "tenant-a"}
    assert _cached(_complete(live, GATEWAY_KEY, prompt, headers=as_a)) >= FULL_HIT
    as_c = {"x-kvasir-tenant": "tenant-c"}
    assert _cached(_complete(live, GATEWAY_KEY, prompt, headers=as_c)) == 0
    refused = _complete(live, KEYS["tenant-b"], prompt, headers=as_a)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "tenant_header_forbidden"
    bad = _complete(live, GATEWAY_KEY, prompt, headers={"x-kvasir-tenant": "bad name!"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_tenant"
    assert _complete(live, "sk-unknown", prompt).status_code == 401
    assert httpx.get(f"{live.base_url}/v1/models", timeout=10).status_code == 401


def test_per_tenant_metrics_with_bounded_labels(live: LiveServer) -> None:
    live.wait_idle()
    before = live.metrics()
    prompt = _prompt(6)[:40]
    resp = _complete(live, KEYS["tenant-b"], prompt, max_tokens=3, ignore_eos=True)
    assert resp.status_code == 200
    for i in range(10):  # more gateway-named tenants than the 6 labels allowed
        gw = _complete(live, GATEWAY_KEY, prompt, headers={"x-kvasir-tenant": f"many-{i}"})
        assert gw.status_code == 200
    live.wait_idle()
    after = live.metrics()

    def delta(name: str, tenant: str) -> float:
        key = (name, (("tenant", tenant),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("kvasir:tenant_requests_total", "tenant-b") == 1
    assert delta("kvasir:tenant_prompt_tokens_total", "tenant-b") == 40
    assert delta("kvasir:tenant_generation_tokens_total", "tenant-b") == 3
    assert delta("kvasir:tenant_request_queue_time_seconds_count", "tenant-b") == 1
    tenants = {dict(labels).get("tenant") for (name, labels) in after
               if name == "kvasir:tenant_requests_total"}
    # At most 6 tenants of their own (the key file's 4 first), the rest under "other".
    assert "other" in tenants and len(tenants - {"other"}) <= 6
    assert "tenant-b" in tenants and "many-9" not in tenants
    assert live.state.metrics.tenant_label("pub-2") == "pub-2"  # reserved, though unused here
    assert delta("kvasir:tenant_requests_total", "other") >= 1
    assert not any(k in live.get("/metrics").text for k in KEYS.values())


@pytest.mark.parametrize("text, message", [
    ("a:k1\nb:k1\n", r"keys.txt:2: duplicate key \(already given at .*keys.txt:1"),
    ("a:k1\n:k2\n", r"keys.txt:2: empty tenant name"),
    ("a:k1\n\n# c\nbad tenant:k3\n", r"keys.txt:4: tenant name 'bad tenant' is not"),
    ("a:\n", r"keys.txt:1: empty key after 'a:'"),
    ("# only a comment\n", r"holds no key"),
])
def test_key_file_errors_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        server_config_from_args(build_parser().parse_args(["serve", "--api-key-file", str(path)]))


def test_shared_groups_are_validated() -> None:
    def parse(*groups: str) -> object:
        argv = ["serve"] + [x for g in groups for x in ("--prefix-cache-shared-tenants", g)]
        return server_config_from_args(build_parser().parse_args(argv))

    with pytest.raises(ValueError, match="at least two tenants"):
        parse("solo")
    with pytest.raises(ValueError, match="already in another shared group"):
        parse("a,b", "b,c")


def test_metrics_behind_a_token_and_probes_answer_head(tiny_model: Path) -> None:
    with live_server(tiny_config(tiny_model), metrics_token="scrape-me") as live:
        assert live.get("/metrics").status_code == 401
        wrong = live.get("/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "--metrics-token" in wrong.json()["error"]["message"]
        ok = live.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
        assert ok.status_code == 200 and "vllm:num_requests_running" in ok.text
        for path in ("/health", "/ready"):
            assert httpx.head(live.base_url + path, timeout=30).status_code == 200, path
        assert httpx.head(live.base_url + "/metrics", timeout=30,
                          headers={"Authorization": "Bearer scrape-me"}).status_code == 200


def test_unknown_model_is_404_and_models_hide_the_host_path(server: LiveServer) -> None:
    resp = server.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["code"] == "model_not_found"
    card = server.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert "/" not in card["data"][0]["root"]
