"""OpenTelemetry traces through the gateway: a gateway.request span with auth, quota, route and
one attempt span per upstream send; the attempt's traceparent goes upstream, so a real engine's
llm_request span is its child in the same trace. Off by default: nothing built, nothing sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")
from gateway_support import (  # noqa: E402
    KEYS,
    FakeEngine,
    fake_engines,
    gateway,
    post,
    wait_until,
)
from harness import LiveServer, live_server, tiny_config  # noqa: E402
from helpers import write_checkpoint  # noqa: E402
from kvasir_engine.server.tracing import TracingConfig  # noqa: E402
from kvasir_gateway.config import GatewayConfig, QuotaLimits, config_from_args  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode  # noqa: E402

GATEWAY_KEY = "gw-trusted-secret"
ENDPOINT = "http://127.0.0.1:4317"  # never reached: the in-memory exporters replace OTLP's


@pytest.fixture(scope="module")
def engine_spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory,
           engine_spans: InMemorySpanExporter) -> Iterator[LiveServer]:
    model = write_checkpoint(tmp_path_factory.mktemp("tiny-llama-traced"), "llama")
    with live_server(tiny_config(model), trusted_gateway_keys=(f"gateway:{GATEWAY_KEY}",),
                     tracing=TracingConfig(otlp_traces_endpoint=ENDPOINT),
                     span_exporter=engine_spans, warmup=False) as live:
        yield live


def _flushed(app: object, exporter: InMemorySpanExporter,
             num_requests: int = 1) -> list[ReadableSpan]:
    """The spans out, once the requests' spans ended (just after the answer's last byte)."""
    provider = app.state.gateway.tracer_provider  # type: ignore[attr-defined]

    def ended() -> bool:
        assert provider is not None and provider.force_flush()
        return sum(s.name == "gateway.request"
                   for s in exporter.get_finished_spans()) >= num_requests

    wait_until(ended, what="the gateway.request spans")
    return list(exporter.get_finished_spans())


def _one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    [found] = [s for s in spans if s.name == name]
    return found


def _span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def test_the_engine_span_is_the_child_of_the_gateway_attempt(
        engine: LiveServer, engine_spans: InMemorySpanExporter, key_file: Path) -> None:
    spans = InMemorySpanExporter()
    with gateway(backends=(engine.base_url,), api_key_file=str(key_file),
                 upstream_key=GATEWAY_KEY, otlp_traces_endpoint=ENDPOINT, span_exporter=spans,
                 tenant_limits={"alice": QuotaLimits(tokens_per_minute=10_000)}) as gw:
        for stream in (False, True):
            spans.clear()
            engine_spans.clear()
            body = {"model": engine.state.model_name, "prompt": "hello world",
                    "max_tokens": 4, "temperature": 0, "stream": stream}
            resp = post(gw.url, "/v1/completions", body, key=KEYS["alice"], timeout=60)
            assert resp.status_code == 200, resp.text
            ours = _flushed(gw.app, spans)
            tracer = engine.state.tracer
            assert tracer is not None and tracer.provider.force_flush()
            theirs = list(engine_spans.get_finished_spans())

            request = _one(ours, "gateway.request")
            assert request.parent is None  # the client sent no traceparent
            assert request.context is not None
            trace_id = request.context.trace_id
            assert {s.context.trace_id for s in ours + theirs if s.context} == {trace_id}
            for name in ("gateway.auth", "gateway.quota", "gateway.route", "gateway.attempt"):
                child = _one(ours, name)
                assert child.parent is not None and child.parent.span_id == _span_id(request)
            a = dict(request.attributes or {})
            assert (a["kvasir.tenant"], a["http.response.status_code"]) == ("alice", 200)
            assert a["gen_ai.request.model"] == engine.state.model_name
            quota = dict(_one(ours, "gateway.quota").attributes or {})
            assert quota["kvasir.quota.allowed"] is True
            assert quota["kvasir.quota.unlimited"] is False
            route = dict(_one(ours, "gateway.route").attributes or {})
            assert (route["kvasir.routing.policy"], route["kvasir.replica"]) == (
                "prefix", engine.base_url)
            attempt = _one(ours, "gateway.attempt")
            at = dict(attempt.attributes or {})
            assert (at["kvasir.pool"], at["kvasir.replica"], at["http.response.status_code"]) \
                == (engine.state.model_name, engine.base_url, 200)

            llm_request = _one(theirs, "llm_request")
            assert llm_request.parent is not None and llm_request.parent.is_remote
            assert llm_request.parent.span_id == _span_id(attempt)
            assert (llm_request.attributes or {})["kvasir.tenant"] == "alice"
            assert (llm_request.attributes or {})["gen_ai.usage.completion_tokens"] == 4


def test_each_attempt_has_its_span_and_a_client_traceparent_is_the_parent() -> None:
    failing, working = FakeEngine(status=503), FakeEngine()
    spans = InMemorySpanExporter()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with fake_engines(failing, working) as served, \
            gateway(backends=tuple(s.url for s in served), routing="round_robin",
                    otlp_traces_endpoint=ENDPOINT, span_exporter=spans) as gw:
        # round robin: of two requests, one at least goes to the failing replica first
        for _ in range(2):
            resp = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"},
                              headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                              timeout=10)
            assert resp.status_code == 200, resp.text
        ours = _flushed(gw.app, spans, num_requests=2)
    requests = [s for s in ours if s.name == "gateway.request"]
    assert len(requests) == 2
    for request in requests:
        assert request.parent is not None
        assert format(request.parent.span_id, "016x") == parent_id
    retried = next(r for r in requests
                   if sum(s.name == "gateway.attempt" and s.parent is not None
                          and s.parent.span_id == _span_id(r) for s in ours) == 2)
    attempts = sorted((s for s in ours if s.name == "gateway.attempt" and s.parent is not None
                       and s.parent.span_id == _span_id(retried)),
                      key=lambda s: s.start_time or 0)
    statuses = [(s.attributes or {})["http.response.status_code"] for s in attempts]
    assert statuses == [503, 200]
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert [(s.attributes or {})["kvasir.attempt"] for s in attempts] == [0, 1]
    # each replica saw the attempt that reached it as the parent, in the client's trace
    sent = {received["headers"]["traceparent"]
            for fake in (failing, working) for received in fake.received}
    for attempt in attempts:
        assert f"00-{trace_id}-{_span_id(attempt):016x}-01" in sent


def test_refusals_are_in_the_spans(key_file: Path) -> None:
    spans = InMemorySpanExporter()
    with fake_engines(FakeEngine()) as served, \
            gateway(backends=(served[0].url,), api_key_file=str(key_file),
                    otlp_traces_endpoint=ENDPOINT, span_exporter=spans,
                    tenant_limits={"alice": QuotaLimits(tokens_per_minute=10)}) as gw:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 100}
        assert post(gw.url, "/v1/completions", body, key="sk-wrong").status_code == 401
        assert post(gw.url, "/v1/completions", body, key=KEYS["alice"]).status_code == 429
        ours = _flushed(gw.app, spans, num_requests=2)
    refused_key, refused_quota = sorted((s for s in ours if s.name == "gateway.request"),
                                        key=lambda s: s.start_time or 0)
    assert (refused_key.attributes or {})["http.response.status_code"] == 401
    auth = {s.parent.span_id: s.status.status_code
            for s in ours if s.name == "gateway.auth" and s.parent is not None}
    assert auth == {_span_id(refused_key): StatusCode.ERROR,
                    _span_id(refused_quota): StatusCode.UNSET}
    assert (refused_quota.attributes or {})["http.response.status_code"] == 429
    quota = dict(_one(ours, "gateway.quota").attributes or {})
    assert quota["kvasir.quota.allowed"] is False and quota["kvasir.quota.refused_by"]
    assert not any(s.name == "gateway.attempt" for s in ours)


def test_off_by_default_nothing_is_built_or_sent() -> None:
    fake = FakeEngine()
    with fake_engines(fake) as served, gateway(backends=(served[0].url,)) as gw:
        assert post(gw.url, "/v1/completions", {"model": "tiny", "prompt": "hi"}).status_code \
            == 200
        ctx = gw.app.state.gateway
        assert ctx.tracer is None and ctx.tracer_provider is None
        assert "traceparent" not in fake.received[-1]["headers"]


def test_sample_ratio_zero_keeps_no_root_trace() -> None:
    spans, fake = InMemorySpanExporter(), FakeEngine()
    with fake_engines(fake) as served, \
            gateway(backends=(served[0].url,), otlp_traces_endpoint=ENDPOINT,
                    otlp_traces_sample_ratio=0.0, span_exporter=spans) as gw:
        assert post(gw.url, "/v1/completions", {"model": "tiny", "prompt": "hi"}).status_code \
            == 200
        # the decision travels upstream: not sampled, so the engine records nothing either
        flags = fake.received[-1]["headers"]["traceparent"].rsplit("-", 1)[1]
        assert int(flags, 16) & 1 == 0  # W3C's sampled bit
        provider = gw.app.state.gateway.tracer_provider
        assert provider is not None and provider.force_flush()
        assert spans.get_finished_spans() == ()


def test_tracing_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVASIR_GATEWAY_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "KVASIR_GATEWAY_OTLP_TRACES_SAMPLE_RATIO", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    c = config_from_args([])
    assert (c.otlp_traces_endpoint, c.otlp_traces_sample_ratio) == (None, None)
    c = config_from_args(["--otlp-traces-endpoint", ENDPOINT, "--otlp-traces-sample-ratio", "0.1"])
    assert (c.otlp_traces_endpoint, c.otlp_traces_sample_ratio) == (ENDPOINT, 0.1)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://otel:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    c = config_from_args([])
    assert (c.otlp_traces_endpoint, c.otlp_traces_protocol) == (
        "http://otel:4318/v1/traces", "http/protobuf")
    monkeypatch.setenv("KVASIR_GATEWAY_OTLP_TRACES_ENDPOINT", ENDPOINT)
    monkeypatch.setenv("KVASIR_GATEWAY_OTLP_TRACES_SAMPLE_RATIO", "0.5")
    c = config_from_args([])
    assert (c.otlp_traces_endpoint, c.otlp_traces_sample_ratio) == (ENDPOINT, 0.5)
    with pytest.raises(ValueError, match="--otlp-traces-sample-ratio"):
        GatewayConfig(otlp_traces_sample_ratio=2.0)
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        GatewayConfig(otlp_traces_protocol="smoke-signals")
