"""A cascade over two real Kvasir engines on 127.0.0.1: the default model (SmolLM2-135M-Instruct)
served twice, configured differently (int4 weights as "small", bfloat16 as "large"). The gateway asks the
small one for logprobs and checks them, escalates to the large one, shadows to it, settles the
tenant's tokens from both engines' usage, and measures each pool's output tokens/s from their
`vllm:generation_tokens_total`."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
from gateway_support import gateway, post, wait_until  # noqa: E402
from harness import LiveServer, live_server, tiny_config  # noqa: E402
from helpers import default_gguf_path  # noqa: E402
from kvasir_gateway.aliases import parse_routing  # noqa: E402
from kvasir_gateway.config import QuotaLimits  # noqa: E402


def served(model: Path, name: str, dtype: str, quantization: str | None) -> Any:
    config = tiny_config(model, kv_bytes=32 << 20)
    return dataclasses.replace(config, model=dataclasses.replace(
        config.model, served_model_name=name, dtype=dtype, quantization=quantization))


@pytest.fixture(scope="module")
def pools() -> Iterator[tuple[LiveServer, LiveServer]]:
    model = default_gguf_path()
    with live_server(served(model, "small", "float32", "int4"), api_keys=()) as small, \
            live_server(served(model, "large", "bfloat16", None), api_keys=()) as large:
        yield small, large


ROUTING = {
    "aliases": {
        # any answer is confident enough: the small pool answers, every answer is shadowed
        "easy": {"cascade": ["small", "large"], "checks": {"min_mean_logprob": -100.0, "length": False},
                 "shadow": {"fraction": 1.0}},
        # no answer of this model is this confident: always escalated
        "strict": {"cascade": ["small", "large"], "checks": {"min_mean_logprob": -0.0001, "length": False}},
    },
    "pools": {"small": {"cost_per_hour": 1.0}, "large": {"cost_per_hour": 4.0}},
}


def sample(gw: Any, name: str, **labels: str) -> float:
    value = gw.app.state.gateway.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


def settled_tokens(gw: Any, num_requests: int) -> float:
    """The tenant's admitted tokens once `num_requests` are counted (a request is counted
    after its settlement, which runs after the client had the answer's last byte)."""
    wait_until(lambda: sample(gw, "kvasir_gateway_requests_total", tenant="anonymous",
                              code="200") == num_requests, timeout=30, what="settlements")
    return sample(gw, "kvasir_gateway_tokens_admitted_total", tenant="anonymous")


def test_cascade_over_two_real_engines(pools: tuple[LiveServer, LiveServer]) -> None:
    small, large = pools
    limits = {"anonymous": QuotaLimits(tokens_per_minute=100_000)}
    with gateway(backends=(small.base_url, large.base_url), tenant_limits=limits,
                 routing_table=parse_routing(ROUTING)) as gw:
        body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        resp = post(gw.url, "/v1/completions", {**body, "model": "easy"}, timeout=60)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert answer["model"] == "small" and resp.headers["x-kvasir-model"] == "small"
        assert answer["choices"][0]["logprobs"] is None  # asked for the check, stripped
        wait_until(lambda: sample(gw, "kvasir_gateway_shadow_comparisons_total", alias="easy",
                                  rule="default", outcome="agree")
                   + sample(gw, "kvasir_gateway_shadow_comparisons_total", alias="easy",
                            rule="default", outcome="disagree") == 1, timeout=60,
                   what="the shadow's comparison")
        # a streaming client of the small pool: its buffered answer, the same greedy tokens
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=60,
                          json={**body, "model": "easy", "stream": True}) as stream:
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == answer["choices"][0]["text"]

        admitted = settled_tokens(gw, 2)
        resp = post(gw.url, "/v1/completions", {**body, "model": "strict"}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "large" and resp.headers["x-kvasir-model"] == "large"
        assert resp.headers["x-kvasir-escalations"] == "small=logprob"
        assert sample(gw, "kvasir_gateway_cascade_escalations_total", alias="strict",
                      model="small", check="logprob") == 1
        usage = resp.json()["usage"]
        both = usage["total_tokens"] + usage["prompt_tokens"] + 6  # the small's attempt too
        assert settled_tokens(gw, 3) - admitted == both

        def rate(pool: str) -> float:
            return sample(gw, "kvasir_gateway_pool_output_tokens_per_second", pool=pool)

        def both_generating() -> bool:
            # The rate covers the last 30 s of scrapes: on a slow host the cascade's tokens may
            # already be older than that, so each pool generates a few more first.
            for pool in ("small", "large"):
                assert post(gw.url, "/v1/completions", {**body, "model": pool},
                            timeout=60).status_code == 200
            time.sleep(0.5)  # a scrape or two (0.2 s probes) after the tokens
            return rate("small") > 0 and rate("large") > 0

        wait_until(both_generating, timeout=60, what="both pools' measured output tokens/s")
        page = httpx.get(gw.url + "/metrics").text
        assert 'kvasir_gateway_cost_per_million_output_tokens{load="measured",pool="small"}' \
            in page
