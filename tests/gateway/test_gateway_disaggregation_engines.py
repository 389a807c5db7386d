"""Two-stage routing through the gateway in front of a real producer engine process and a real
consumer engine server (tiny random checkpoint, 127.0.0.1), both trusting the gateway's key.

The gateway learns their roles from /version, sends a long prompt to the producer, then the
request with the producer's kv_transfer_params to the consumer. The reference for the greedy
answer is the engine tests' (tests/engine/kv_transfer/test_disaggregation.py): the consumer's
own answer with the prompt's prefix in its cache, which under float32 is also its cold answer
(under bfloat16 the engine's own prefix-cache hit may round differently from a cold prefill).
Separate `cache_salt`s keep the runs from sharing blocks, so a disaggregated run has nothing of
its prompt cached on the consumer and every block comes from the producer.

Also: the tenant is charged once, by the decode answer's usage; a client leaving the decode
stream aborts the consumer's request; a short prompt never reaches the producer; a dead
producer leaves the prompt to the consumer, with the same answer. (A client leaving during the
prefill stage is tested against fake engines, test_gateway_disaggregation.py: a tiny model's
prefill ends before a test can leave it.)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
from gateway_support import (  # noqa: E402
    KEYS,
    disaggregation_counts,
    gateway,
    metric_value,
    wait_until,
)
from harness import LiveServer, live_server, tiny_config  # noqa: E402
from helpers import write_checkpoint  # noqa: E402
from kvasir_engine.config import KVTransferConfig  # noqa: E402
from kvasir_gateway.config import QuotaLimits  # noqa: E402
from processes import free_port, start_engine, wait_ready  # noqa: E402

GATEWAY_KEY = "gw-disagg-secret"
# 20 to 29 token ids, above the min prompt tokens the gateways below use (16).
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(20 + 3 * i)] for i in range(4)]
MAX_TOKENS = 8


def num_blocks(prompt: list[int]) -> int:
    """The blocks (of 4) a producer holds for a prompt: its all-but-last tokens'."""
    return -(-(len(prompt) - 1) // 4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama-disagg"), "llama")


@dataclasses.dataclass
class Pair:
    producer_url: str
    consumer: LiveServer
    stop_producer: Any  # () -> None: the producer process is killed

    def received_blocks(self) -> int:
        connector = self.consumer.state.kv_connector
        assert connector is not None and sum(connector.stats.fallbacks.values()) == 0
        return int(connector.stats.num_blocks["received"])


@contextlib.contextmanager
def engine_pair(model: Path, log_dir: Path, dtype: str, kv_mib: int = 4,
                batch_invariant: bool = False) -> Iterator[Pair]:
    """A producer process and an in-process consumer, the same model, layout and dtype, each
    with `kv_mib` MiB of KV cache, both `--batch-invariant` or neither."""
    key_file = log_dir / "gateway.key"
    key_file.write_text(f"gateway:{GATEWAY_KEY}\n")
    port = free_port()
    transfer = {"kv_connector": "TCPConnector", "kv_role": "kv_producer",
                "kv_ip": "127.0.0.1", "kv_port": free_port()}
    node = start_engine("serve", model, log_dir / f"producer-{port}.log",
                        "--host", "127.0.0.1", "--port", str(port),
                        "--trusted-gateway-key-file", str(key_file),
                        "--served-model-name", "test", "--max-model-len", "256",
                        "--block-size", "4", "--kv-cache-memory", f"{kv_mib}MiB",
                        "--dtype", dtype,
                        "--device", "cpu", "--no-warmup",
                        "--kv-transfer-config", json.dumps(transfer),
                        *(["--batch-invariant"] if batch_invariant else []))
    base = tiny_config(model, prefix_caching=True, kv_bytes=kv_mib << 20)
    config = dataclasses.replace(base, model=dataclasses.replace(base.model, dtype=dtype),
                                 device=dataclasses.replace(base.device,
                                                            batch_invariant=batch_invariant),
                                 kv_transfer=KVTransferConfig("TCPConnector", "kv_consumer"))
    try:
        producer_url = f"http://127.0.0.1:{port}"
        wait_ready(node, producer_url)
        with live_server(config, api_keys=("direct:sk-direct",),
                         trusted_gateway_keys=(f"gateway:{GATEWAY_KEY}",)) as consumer:
            yield Pair(producer_url, consumer, node.stop)
    finally:
        node.stop()


@contextlib.contextmanager
def gateway_for(pair: Pair, mode: str, **overrides: Any) -> Iterator[str]:
    with gateway(backends=(pair.producer_url, pair.consumer.base_url), upstream_key=GATEWAY_KEY,
                 disaggregation=mode, disaggregation_min_prompt_tokens=16, **overrides) as gw:
        roles = {r.kv_role for r in gw.app.state.gateway.replicas.replicas.values()}
        assert roles == {"kv_producer", "kv_consumer"}  # learned from each engine's /version
        yield gw.url


def complete(url: str, prompt: list[int], salt: str, stream: bool = False,
             key: str | None = None) -> dict[str, Any]:
    """The greedy answer's text and usage, streamed (with the usage asked for) or not."""
    body: dict[str, Any] = {"model": "test", "prompt": prompt, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "ignore_eos": True, "cache_salt": salt}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if not stream:
        resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        return {"text": answer["choices"][0]["text"], "usage": answer["usage"]}
    body.update(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return {"text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
            "usage": chunks[-1]["usage"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_is_the_same_with_and_without_disaggregation(
        tiny_model: Path, tmp_path: Path, dtype: str) -> None:
    with engine_pair(tiny_model, tmp_path, dtype) as pair:
        with gateway_for(pair, "never") as url:  # the consumer alone: cold, then cached
            cold = [complete(url, p, "local")["text"] for p in PROMPTS]
            cached = [complete(url, p, "local")["text"] for p in PROMPTS]
            assert disaggregation_counts(url) == {("local", "forced"): 2.0 * len(PROMPTS)}
        assert pair.received_blocks() == 0
        if dtype == "float32":
            assert cached == cold
        with gateway_for(pair, "always") as url:
            # one request alone, not streamed, then all at once, streamed
            assert complete(url, PROMPTS[0], "remote")["text"] == cached[0]
            assert pair.received_blocks() == num_blocks(PROMPTS[0])
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                streamed = list(pool.map(lambda p: complete(url, p, "again", stream=True),
                                         PROMPTS))
            assert [s["text"] for s in streamed] == cached
            assert all(s["usage"]["completion_tokens"] == MAX_TOKENS for s in streamed)
            assert disaggregation_counts(url) == {("remote", "prefill"): 1.0 + len(PROMPTS)}
        assert pair.received_blocks() == sum(map(num_blocks, [PROMPTS[0], *PROMPTS]))


def test_charged_once_cancelled_short_prompts_stay_and_a_dead_producer_costs_nothing(
        tiny_model: Path, tmp_path: Path, key_file: Path) -> None:
    with engine_pair(tiny_model, tmp_path, "float32") as pair, \
            gateway_for(pair, "auto", api_key_file=str(key_file), probe_failure_threshold=100,
                        tenant_limits={"alice": QuotaLimits(tokens_per_minute=10_000)}) as url:
        # The tenant is charged the decode answer's usage only, streamed or not.
        whole = complete(url, PROMPTS[1], "a", key=KEYS["alice"])
        streamed = complete(url, PROMPTS[2], "a", stream=True, key=KEYS["alice"])
        for answer, prompt in ((whole, PROMPTS[1]), (streamed, PROMPTS[2])):
            usage = answer["usage"]  # the decode answer's, not the prefill's one token
            assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]
                    ) == (len(prompt), MAX_TOKENS, len(prompt) + MAX_TOKENS)
        charged = whole["usage"]["total_tokens"] + streamed["usage"]["total_tokens"]
        wait_until(lambda: metric_value(url, "kvasir_gateway_tokens_admitted_total",
                                        tenant="alice") == charged, what="the settlement")
        assert pair.received_blocks() == num_blocks(PROMPTS[1]) + num_blocks(PROMPTS[2])
        # A client leaving the decode stage's stream aborts the consumer's request.
        body = {"model": "test", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True, "cache_salt": "gone"}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEYS['bob']}"}) as resp:
            assert resp.status_code == 200
            next(line for line in resp.iter_lines() if line.startswith("data: "))
        wait_until(lambda: pair.consumer.metric("vllm:request_success_total",
                                                finished_reason="abort") == 1,
                   what="the consumer's request aborted")
        assert pair.received_blocks() == sum(map(num_blocks, PROMPTS[:3]))
        # A prompt under the threshold (16) is computed on the consumer; the producer sees none.
        produced = metric_value(pair.producer_url, "vllm:prompt_tokens_total")
        assert produced == sum(map(len, PROMPTS[:3]))
        complete(url, PROMPTS[0][:12], "a", key=KEYS["bob"])
        assert metric_value(pair.producer_url, "vllm:prompt_tokens_total") == produced
        # The producer dies: the consumer computes the prompt, with the same answer.
        reference = complete(url, PROMPTS[3], "b", key=KEYS["bob"])["text"]
        num_received = pair.received_blocks()
        pair.stop_producer()
        assert complete(url, PROMPTS[3], "c", key=KEYS["bob"])["text"] == reference
        assert pair.received_blocks() == num_received
        assert disaggregation_counts(url) == {("remote", "prefill"): 4.0,
                                              ("local", "short"): 1.0,
                                              ("local", "prefill_failed"): 1.0}

