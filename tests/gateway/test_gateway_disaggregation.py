"""Two-stage routing in front of fake engines that report KV-transfer roles (replicas.py,
disaggregation.py): what each stage is sent, when the prompt stays on the decode replica and
why (the metric), and that a client leaving during either stage closes that stage's upstream
call. Real producer and consumer engines: test_gateway_disaggregation_engines.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from gateway_support import (
    PRODUCER_PARAMS,
    FakeEngine,
    disaggregation_counts,
    fake_engines,
    gateway,
    metric_value,
    post,
    wait_until,
)
from kvasir_gateway.aliases import parse_routing
from kvasir_gateway.config import QuotaLimits
from kvasir_gateway.disaggregation import DisaggregationMode, decide, is_transferable
from kvasir_gateway.replicas import Replica

LONG = list(range(100, 140))  # 40 token ids: 40 tokens estimated
SHORT = list(range(100, 108))


def pair(**producer: Any) -> tuple[FakeEngine, FakeEngine]:
    return (FakeEngine(kv_role="kv_producer", **producer),
            FakeEngine(kv_role="kv_consumer", num_chunks=4))


def test_the_prompt_goes_to_the_producer_and_its_params_to_the_consumer() -> None:
    producer, consumer = pair()
    with fake_engines(producer, consumer) as (p, c), \
            gateway(backends=(p.url, c.url), disaggregation_min_prompt_tokens=16) as gw:
        replicas = gw.app.state.gateway.replicas.replicas
        assert {r.kv_role for r in replicas.values()} == {"kv_producer", "kv_consumer"}
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": False}}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=10) as resp:
            assert resp.status_code == 200
            text = resp.read().decode()
        assert "t3" in text and text.rstrip().endswith("data: [DONE]")
        [prefill] = [r["body"] for r in producer.received]
        assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
        assert prefill["stream"] is False and "stream_options" not in prefill
        assert prefill["prompt"] == LONG and prefill["max_tokens"] == 5
        [decode] = [r["body"] for r in consumer.received]
        assert decode["kv_transfer_params"] == PRODUCER_PARAMS and decode["stream"] is True
        # a short prompt stays on the decode replica; the producer sees nothing of it
        resp = post(gw.url, "/v1/completions", {"model": "tiny", "prompt": SHORT})
        assert resp.status_code == 200 and len(producer.received) == 1
        assert "kv_transfer_params" not in consumer.received[-1]["body"]
        # several prompts or choices cannot be transferred: local, the producer untouched
        for extra in ({"n": 2}, {"echo": True, "logprobs": 1}):
            assert post(gw.url, "/v1/completions",
                        {"model": "tiny", "prompt": LONG, **extra}).status_code == 200
        assert len(producer.received) == 1
        assert disaggregation_counts(gw.url) == {("remote", "prefill"): 1.0,
                                                 ("local", "short"): 1.0,
                                                 ("local", "unsupported"): 2.0}


@pytest.mark.parametrize("mode, body, expected", [
    ("never", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 200}]},
     ("local", "forced")),
    ("always", {"model": "tiny", "prompt": SHORT}, ("remote", "prefill")),
])
def test_modes(mode: str, body: dict[str, Any], expected: tuple[str, str]) -> None:
    producer, consumer = pair()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with fake_engines(producer, consumer) as (p, c), \
            gateway(backends=(p.url, c.url), disaggregation=mode,
                    disaggregation_min_prompt_tokens=16) as gw:
        assert post(gw.url, path, body).status_code == 200
        assert disaggregation_counts(gw.url) == {expected: 1.0}
        assert len(producer.received) == (1 if expected[0] == "remote" else 0)
        assert len(consumer.received) == 1


@pytest.mark.parametrize("failure", ["error", "timeout", "down"])
def test_a_failed_prefill_leaves_the_prompt_to_the_decode_replica(failure: str) -> None:
    producer, consumer = pair(status=500 if failure == "error" else 200,
                              answer_delay=5.0 if failure == "timeout" else 0.0)
    with fake_engines(producer, consumer) as (p, c), \
            gateway(backends=(p.url, c.url), disaggregation_min_prompt_tokens=16,
                    disaggregation_prefill_timeout_seconds=0.3,
                    probe_failure_threshold=100) as gw:
        if failure == "down":  # still routable for the gateway: its connection is refused
            p.__exit__(None, None, None)
        resp = post(gw.url, "/v1/completions", {"model": "tiny", "prompt": LONG})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "aaaa"
        assert "kv_transfer_params" not in consumer.received[0]["body"]
        assert disaggregation_counts(gw.url) == {("local", "prefill_failed"): 1.0}
        if failure == "timeout":  # the stalled prefill's connection was closed
            wait_until(lambda: producer.cancelled, what="the producer saw the call closed")


def test_a_long_prefill_queue_keeps_the_prompt_local() -> None:
    producer, consumer = pair(num_waiting=8)  # 8 others' prompts of >= 16 tokens: 128
    with fake_engines(producer, consumer) as (p, c), \
            gateway(backends=(p.url, c.url), disaggregation_min_prompt_tokens=16) as gw:
        assert post(gw.url, "/v1/completions", {"model": "tiny", "prompt": LONG}
                    ).status_code == 200
        long_enough = {"model": "tiny", "prompt": list(range(100, 300))}  # 200 > 128
        assert post(gw.url, "/v1/completions", long_enough).status_code == 200
        assert disaggregation_counts(gw.url) == {("local", "queue"): 1.0,
                                                 ("remote", "prefill"): 1.0}


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_a_client_leaving_closes_the_stage_in_flight(stage: str) -> None:
    producer = FakeEngine(kv_role="kv_producer", answer_delay=10.0 if stage == "prefill" else 0)
    consumer = FakeEngine(kv_role="kv_consumer", num_chunks=200, chunk_delay=0.05)
    with fake_engines(producer, consumer) as (p, c), \
            gateway(backends=(p.url, c.url), disaggregation_min_prompt_tokens=16) as gw:
        body = {"model": "tiny", "prompt": LONG, "stream": True}
        if stage == "prefill":
            client = threading.Thread(target=_post_and_leave, args=(gw.url, body), daemon=True)
            client.start()
            wait_until(lambda: producer.received, what="the prefill stage")
            client.join(5)
            wait_until(lambda: producer.cancelled, what="the prefill call closed")
            time.sleep(0.3)
            assert not consumer.received  # the decode stage never started
        else:
            with httpx.stream("POST", gw.url + "/v1/completions", json=body,
                              timeout=10) as resp:
                next(resp.iter_lines())
            wait_until(lambda: consumer.cancelled, what="the decode stream closed")
            assert len(producer.received) == 1 and not producer.cancelled
        wait_until(lambda: gw.app.state.gateway.metrics.in_flight._value.get() == 0,
                   what="no call in flight")


def _post_and_leave(url: str, body: dict[str, Any]) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=0.5)


def test_clients_do_not_set_kv_transfer_params() -> None:
    producer, consumer = pair()
    with fake_engines(producer, consumer) as (p, c), gateway(backends=(p.url, c.url)) as gw:
        resp = post(gw.url, "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                "kv_transfer_params": PRODUCER_PARAMS})
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "kv_transfer_params"
        assert not consumer.received and not producer.received


def test_plain_pools_are_served_as_before_and_whole_requests_skip_producers() -> None:
    plain, producer = FakeEngine(), FakeEngine(kv_role="kv_producer")
    with fake_engines(plain, producer) as (a, b), \
            gateway(backends=(a.url, b.url), disaggregation="always") as gw:
        for _ in range(4):
            assert post(gw.url, "/v1/completions", {"model": "tiny", "prompt": LONG}
                        ).status_code == 200
        # no consumer: nothing to decide, nothing counted; the producer takes no whole request
        assert len(plain.received) == 4 and not producer.received
        assert disaggregation_counts(gw.url) == {}


def _replica(url: str, role: str | None, **state: Any) -> Replica:
    replica = Replica(url, is_ready=True, kv_role=role, model_ids=frozenset({"m"}))
    for name, value in state.items():
        setattr(replica, name, value)
    return replica


def _reason(mode: DisaggregationMode, prompt_tokens: int, pool: list[Replica]) -> str | None:
    decision = decide(mode, 64, prompt_tokens, {"model": "m", "prompt": "x"}, pool)
    return None if decision is None else decision.reason


def test_decide() -> None:
    consumer, producer = _replica("c", "kv_consumer"), _replica("p", "kv_producer")
    auto = DisaggregationMode.AUTO
    assert _reason(auto, 100, [consumer]) == "no_prefill"
    assert _reason(auto, 100, [producer, _replica("x", None)]) is None  # no consumer
    assert _reason(auto, 63, [producer, consumer]) == "short"
    assert _reason(auto, 64, [producer, consumer]) == "prefill"
    busy = _replica("p", "kv_producer", pending_prefill_tokens=80.0, num_waiting=2.0,
                    in_flight_at_scrape=1)  # 80 tokens of ours + 1 other's request (64): 144
    assert _reason(auto, 143, [busy, consumer]) == "queue"
    assert _reason(auto, 144, [busy, consumer]) == "prefill"
    assert _reason(DisaggregationMode.ALWAYS, 1, [_replica("b", "kv_both")]) == "prefill"
    assert _reason(DisaggregationMode.NEVER, 1000, [producer, consumer]) == "forced"
    assert not is_transferable({"prompt": ["a", "b"]})
    assert not is_transferable({"prompt": [[1, 2], [3]]})
    assert not is_transferable({"prompt": "a", "prompt_logprobs": 1})
    assert not is_transferable({"prompt": "a", "n": 2})
    assert is_transferable({"prompt": [1, 2, 3], "n": 1})
    assert is_transferable({"messages": [{"role": "user", "content": "a"}], "logprobs": True})


def test_a_cascade_over_disaggregated_pools_charges_each_answer_once() -> None:
    engines = [FakeEngine(model="small", kv_role="kv_producer"),
               FakeEngine(model="small", kv_role="kv_consumer", text="four", logprob=-3.0),
               FakeEngine(model="large", kv_role="kv_producer"),
               FakeEngine(model="large", kv_role="kv_consumer", text="4")]
    table = parse_routing({"aliases": {"auto": {"cascade": ["small", "large"],
                                                "checks": {"min_mean_logprob": -1.0}}}})
    with fake_engines(*engines) as servers, \
            gateway(backends=tuple(s.url for s in servers), routing_table=table,
                    disaggregation="always",
                    tenant_limits={"anonymous": QuotaLimits(tokens_per_minute=10_000)}) as gw:
        resp = post(gw.url, "/v1/completions", {"model": "auto", "prompt": LONG})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "4"
        assert resp.headers["x-kvasir-escalations"] == "small=logprob"
        small_producer, small_consumer, large_producer, large_consumer = engines
        for producer, consumer in ((small_producer, small_consumer),
                                   (large_producer, large_consumer)):
            assert producer.received[0]["body"]["kv_transfer_params"] == {"do_remote_decode": True}
            assert consumer.received[0]["body"]["kv_transfer_params"] == PRODUCER_PARAMS
        assert small_consumer.received[0]["body"]["logprobs"] == 1  # the check's, as always
        # each pool's decode answer (10 prompt + 3 completion tokens), never a prefill's
        wait_until(lambda: metric_value(gw.url, "kvasir_gateway_tokens_admitted_total",
                                        tenant="anonymous") == 26, what="the settlement")
        assert disaggregation_counts(gw.url) == {("remote", "prefill"): 2.0}


def test_a_decode_replica_answering_503_passes_the_params_to_another() -> None:
    producer = FakeEngine(kv_role="kv_producer")
    refusing = FakeEngine(kv_role="kv_consumer", status=503)
    decoding = FakeEngine(kv_role="kv_consumer", num_waiting=1)  # the busier: tried second
    with fake_engines(producer, refusing, decoding) as servers, \
            gateway(backends=tuple(s.url for s in servers), disaggregation="always") as gw:
        resp = post(gw.url, "/v1/completions", {"model": "tiny", "prompt": LONG})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "aaa"
        for consumer in (refusing, decoding):
            [received] = consumer.received
            assert received["body"]["kv_transfer_params"] == PRODUCER_PARAMS
        assert len(producer.received) == 1  # one prefill for both attempts
