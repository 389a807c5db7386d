"""OpenTelemetry traces of the engine: one llm_request span per request, child of the caller's
traceparent, vLLM's gen_ai.* attributes, the phases as child spans; off by default; sampled."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from harness import API_KEY, LiveServer, live_server, tiny_config
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.engine_types import RequestSpec
from kvasir_engine.frontend.request_output import RequestOutput, RequestTimings
from kvasir_engine.main import build_parser
from kvasir_engine.server.config import ServerConfig, server_config_from_args
from kvasir_engine.server.tracing import TracingConfig, build_request_tracer
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
ON = TracingConfig(otlp_traces_endpoint="http://127.0.0.1:4317")
PROMPT = "the secret word is swordfish"
GREEDY = {"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "ignore_eos": True}


def _post(live: LiveServer, body: dict[str, object], path: str = "/v1/completions",
          traceparent: str | None = TRACEPARENT) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    return httpx.post(live.base_url + path, headers=headers, json=body, timeout=60)


def _spans(live: LiveServer, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    tracer = live.state.tracer
    assert tracer is not None
    assert tracer.provider.force_flush()
    return list(exporter.get_finished_spans())


def _request_span(spans: list[ReadableSpan]) -> ReadableSpan:
    [request] = [s for s in spans if s.name == "llm_request"]
    return request


@pytest.fixture(scope="module")
def traced(tiny_model: Path) -> Iterator[tuple[LiveServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    with live_server(tiny_config(tiny_model), tracing=ON, span_exporter=exporter) as live:
        yield live, exporter


def test_a_request_gives_one_span_under_its_traceparent(
        traced: tuple[LiveServer, InMemorySpanExporter]) -> None:
    live, exporter = traced
    exporter.clear()
    r = _post(live, {"prompt": PROMPT, **GREEDY})
    assert r.status_code == 200, r.text
    spans = _spans(live, exporter)
    request = _request_span(spans)
    assert request.context is not None and request.parent is not None
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(request.parent.span_id, "016x") == PARENT_ID
    assert request.parent.is_remote
    a = dict(request.attributes or {})
    usage = r.json()["usage"]
    assert str(a["gen_ai.request.id"]).startswith(r.json()["id"])
    assert a["gen_ai.response.model"] == live.state.model_name
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.n"]) == (5, 1)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["kvasir.tenant"]
    latency = {name: float(a[f"gen_ai.latency.{name}"])  # type: ignore[arg-type]
               for name in ("time_in_queue", "time_to_first_token", "time_in_model_prefill",
                            "time_in_model_decode", "e2e")}
    assert min(latency.values()) >= 0
    assert latency["e2e"] >= latency["time_to_first_token"] >= latency["time_in_queue"]
    assert "gen_ai.prompt" not in a
    assert not any(PROMPT in str(v) for s in spans for v in (s.attributes or {}).values())
    # The phases: children of the request span, one after the other, filling it.
    phases = {s.name: s for s in spans
              if s.parent is not None and s.parent.span_id == request.context.span_id}
    assert set(phases) == {"queue", "prefill", "decode"}
    q, p, d = phases["queue"], phases["prefill"], phases["decode"]
    assert request.start_time == q.start_time
    assert q.end_time == p.start_time and p.end_time == d.start_time
    assert d.end_time == request.end_time


def test_streamed_and_n_choices_give_a_span_each(
        traced: tuple[LiveServer, InMemorySpanExporter]) -> None:
    live, exporter = traced
    exporter.clear()
    r = _post(live, {"prompt": PROMPT, "n": 2, "stream": True, **GREEDY})
    assert r.status_code == 200, r.text
    requests = [s for s in _spans(live, exporter) if s.name == "llm_request"]
    assert len(requests) == 2
    assert {(s.attributes or {})["gen_ai.request.n"] for s in requests} == {2}
    assert len({(s.attributes or {})["gen_ai.request.id"] for s in requests}) == 2


def test_without_traceparent_the_span_is_a_root(
        traced: tuple[LiveServer, InMemorySpanExporter]) -> None:
    live, exporter = traced
    exporter.clear()
    r = _post(live, {"prompt": PROMPT, **GREEDY}, traceparent=None)
    assert r.status_code == 200, r.text
    assert _request_span(_spans(live, exporter)).parent is None


def test_prompt_text_only_with_the_flag(tiny_model: Path) -> None:
    exporter = InMemorySpanExporter()
    on = TracingConfig(otlp_traces_endpoint="http://127.0.0.1:4317",
                       otlp_traces_include_prompt=True)
    with live_server(tiny_config(tiny_model), tracing=on, span_exporter=exporter,
                     warmup=False) as live:
        r = _post(live, {"prompt": PROMPT, **GREEDY})
        assert r.status_code == 200, r.text
        assert (_request_span(_spans(live, exporter)).attributes or {})["gen_ai.prompt"] == PROMPT
        exporter.clear()
        messages = [{"role": "user", "content": PROMPT}]
        r = _post(live, {"messages": messages, **GREEDY}, path="/v1/chat/completions")
        assert r.status_code == 200, r.text
        prompt = str((_request_span(_spans(live, exporter)).attributes or {})["gen_ai.prompt"])
        assert json.loads(prompt) == messages


def test_off_by_default(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert ServerConfig().tracing.otlp_traces_endpoint is None
    assert server.state.tracer is None  # no provider built, nothing per request
    assert build_request_tracer(TracingConfig(), "m") is None
    config = server_config_from_args(build_parser().parse_args(["serve"]))
    assert config.tracing == TracingConfig()


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str) -> TracingConfig:
        return server_config_from_args(build_parser().parse_args(["serve", *argv])).tracing

    c = parse("--otlp-traces-endpoint", "http://otel:4317", "--otlp-traces-sample-ratio", "0.25",
              "--otlp-traces-include-prompt")
    assert (c.otlp_traces_endpoint, c.otlp_traces_sample_ratio, c.otlp_traces_include_prompt) \
        == ("http://otel:4317", 0.25, True)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    c = parse()
    assert (c.otlp_traces_endpoint, c.otlp_traces_protocol) == (
        "http://collector:4318/v1/traces", "http/protobuf")
    monkeypatch.setenv("KVASIR_OTLP_TRACES_ENDPOINT", "http://kvasir:4317")
    monkeypatch.setenv("KVASIR_OTLP_TRACES_SAMPLE_RATIO", "0.5")
    c = parse()
    assert (c.otlp_traces_endpoint, c.otlp_traces_sample_ratio) == ("http://kvasir:4317", 0.5)
    with pytest.raises(ValueError, match="--otlp-traces-sample-ratio"):
        TracingConfig(otlp_traces_sample_ratio=1.5)
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        TracingConfig(otlp_traces_protocol="carrier-pigeon")


def _finished(spec: RequestSpec) -> RequestOutput:
    return RequestOutput(spec.request_id, "", [1], None, "length", None,
                         num_prompt_tokens=3, num_output_tokens=1, num_cached_tokens=0,
                         timings=RequestTimings(0.01, 0.02, 0.0, 0.03))


class _GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC collector's trace service, keeping what it is sent."""

    def __init__(self) -> None:
        self.received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: object) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def _collector(protocol: str) -> Iterator[tuple[str, list[bytes]]]:
    """A collector on 127.0.0.1 for `protocol`: its endpoint, and the requests it got."""
    received: list[bytes] = []
    if protocol == "grpc":
        receiver = _GrpcReceiver()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            yield f"http://127.0.0.1:{port}", received
            received.extend(r.SerializeToString() for r in receiver.received)
        finally:
            server.stop(grace=None)
        return

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            received.append(self.rfile.read(int(self.headers["content-length"])))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces", received
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_an_otlp_collector(protocol: str) -> None:
    """The real exporters, batched, to a collector on 127.0.0.1 speaking each protocol."""
    with _collector(protocol) as (endpoint, received):
        config = TracingConfig(otlp_traces_endpoint=endpoint, otlp_traces_protocol=protocol)
        tracer = build_request_tracer(config, "tiny")
        assert tracer is not None
        spec = RequestSpec("r-otlp", [1, 2, 3], SamplingParams(max_tokens=1))
        tracer.finish(tracer.begin({"traceparent": TRACEPARENT}, [spec], 1, lambda: [PROMPT]),
                      _finished(spec))
        assert tracer.provider.force_flush(timeout_millis=10_000)
        tracer.shutdown()
    spans = [span for body in received
             for resource in trace_service_pb2.ExportTraceServiceRequest.FromString(body)
             .resource_spans for scope in resource.scope_spans for span in scope.spans]
    [request] = [span for span in spans if span.name == "llm_request"]
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    attributes = {a.key: a.value for a in request.attributes}
    assert attributes["gen_ai.request.id"].string_value == "r-otlp"
    assert {span.name for span in spans} == {"llm_request", "queue", "prefill", "decode"}


def test_sample_ratio_zero_drops_roots_and_follows_a_sampled_parent() -> None:
    exporter = InMemorySpanExporter()
    config = TracingConfig(otlp_traces_endpoint="http://127.0.0.1:4317",
                           otlp_traces_sample_ratio=0.0)
    tracer = build_request_tracer(config, "m", exporter)
    assert tracer is not None
    spec = RequestSpec("r-0", [1, 2, 3], SamplingParams(max_tokens=1))
    for headers in ({}, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}):
        trace = tracer.begin(headers, [spec], 1, lambda: [PROMPT])
        tracer.finish(trace, _finished(spec))
    tracer.provider.force_flush()
    assert exporter.get_finished_spans() == ()
    trace = tracer.begin({"traceparent": TRACEPARENT}, [spec], 1, lambda: [PROMPT])
    tracer.finish(trace, _finished(spec))
    tracer.provider.force_flush()
    assert {s.name for s in exporter.get_finished_spans()} == {
        "llm_request", "queue", "prefill", "decode"}
    tracer.shutdown()


def test_a_request_without_its_final_output_is_recorded_aborted() -> None:
    exporter = InMemorySpanExporter()
    tracer = build_request_tracer(ON, "m", exporter)
    assert tracer is not None
    spec = RequestSpec("r-1", [1, 2, 3], SamplingParams(max_tokens=4))
    tracer.close(tracer.begin({}, [spec], 1, lambda: [PROMPT]))
    tracer.provider.force_flush()
    [span] = exporter.get_finished_spans()
    assert (span.attributes or {})["gen_ai.response.finish_reasons"] == ("abort",)
    assert "gen_ai.usage.completion_tokens" not in (span.attributes or {})
    tracer.shutdown()
