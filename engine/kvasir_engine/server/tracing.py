"""OpenTelemetry traces of generation requests, off unless `--otlp-traces-endpoint` is set.

One `llm_request` span per engine request (a prompt x one of its n choices), a child of the
caller's W3C `traceparent` (a gateway's attempt span), with vLLM's `gen_ai.*` attributes and three
child spans, `queue`, `prefill` and `decode`, placed from the engine's own per-request timings
(`RequestTimings` on the final output). Spans are built when a request ends, from its admission
time plus those durations, so a request in flight holds no open span.

When tracing is off `build_request_tracer` returns None and the request path only checks
`state.tracer is not None`. The provider is this app's own (never the process-global one), its
spans leave through a `BatchSpanProcessor` off the event loop; the prompt text goes into a span
only with `--otlp-traces-include-prompt`, as prompts may hold personal data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvasir_engine.frontend.engine_types import RequestSpec
from kvasir_engine.frontend.request_output import RequestOutput

SPAN_NAME = "llm_request"  # vLLM's
OTLP_PROTOCOLS = ("grpc", "http/protobuf")  # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, as vLLM reads it
_PROPAGATOR = TraceContextTextMapPropagator()
_NS = 1_000_000_000


@dataclass(frozen=True)
class TracingConfig:
    # Where spans go (OTLP); None: tracing off, no provider built.
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = "grpc"
    # Share of root traces kept (ParentBased: a caller's sampled flag wins); None: the SDK's
    # choice from OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, else always on.
    otlp_traces_sample_ratio: float | None = None
    otlp_traces_include_prompt: bool = False
    # OTEL_SERVICE_NAME when set, else this.
    service_name: str = "kvasir-engine"

    def __post_init__(self) -> None:
        ratio = self.otlp_traces_sample_ratio
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"--otlp-traces-sample-ratio must be in [0, 1], got {ratio}")
        if self.otlp_traces_protocol not in OTLP_PROTOCOLS:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of "
                             f"{list(OTLP_PROTOCOLS)}, got {self.otlp_traces_protocol!r}")


def otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )
    return HttpSpanExporter(endpoint=endpoint)


def build_provider(config: TracingConfig,
                   exporter: SpanExporter | None = None) -> TracerProvider | None:
    """The app's provider, or None when tracing is off. `exporter` replaces the OTLP one
    (tests: the SDK's InMemorySpanExporter)."""
    if config.otlp_traces_endpoint is None:
        return None
    sampler: Sampler | None = None
    if config.otlp_traces_sample_ratio is not None:
        sampler = ParentBased(TraceIdRatioBased(config.otlp_traces_sample_ratio))
    resource = Resource.create({SERVICE_NAME: config.service_name})
    provider = TracerProvider(sampler=sampler, resource=resource)
    provider.add_span_processor(BatchSpanProcessor(
        exporter or otlp_exporter(config.otlp_traces_endpoint, config.otlp_traces_protocol)))
    return provider


def parent_context(headers: Mapping[str, str]) -> Context:
    """The caller's span from its W3C `traceparent` (and `tracestate`); empty without one."""
    return _PROPAGATOR.extract(carrier=headers)


@dataclass
class JobTrace:
    """What an HTTP generation call's spans need, kept from its admission to its end."""

    parent: Context
    start_ns: int  # wall clock at admission (time.time_ns), where every span of the call starts
    tenant_id: str
    n: int  # choices per prompt
    # request id -> (its spec, its prompt's text when asked for); removed once its span is out.
    open_requests: dict[str, tuple[RequestSpec, str | None]] = field(default_factory=dict)


class RequestTracer:
    def __init__(self, provider: TracerProvider, model_name: str, include_prompt: bool) -> None:
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("kvasir_engine")
        self.model_name = model_name
        self.include_prompt = include_prompt

    def begin(self, headers: Mapping[str, str], specs: Sequence[RequestSpec], n: int,
              prompt_texts: Callable[[], Sequence[str]]) -> JobTrace:
        """Call before admission: the spans start at this instant. `prompt_texts` (one per
        prompt) is called only with --otlp-traces-include-prompt."""
        texts = prompt_texts() if self.include_prompt else None
        trace = JobTrace(parent_context(headers), time.time_ns(), specs[0].tenant_id, n)
        for i, spec in enumerate(specs):
            trace.open_requests[spec.request_id] = (spec, None if texts is None
                                                    else texts[i // n])
        return trace

    def finish(self, trace: JobTrace, out: RequestOutput) -> None:
        """The span of a request whose final output this is."""
        entry = trace.open_requests.pop(out.request_id, None)
        if entry is not None:
            self._emit(trace, entry, out)

    def close(self, trace: JobTrace) -> None:
        """The call ended (answered, client gone, engine dead): the requests without a final
        output are recorded as aborted, ending now."""
        while trace.open_requests:
            _, entry = trace.open_requests.popitem()
            self._emit(trace, entry, None)

    def shutdown(self) -> None:
        self.provider.shutdown()

    def _emit(self, trace: JobTrace, entry: tuple[RequestSpec, str | None],
              out: RequestOutput | None) -> None:
        spec, prompt = entry
        params = spec.params
        attributes: dict[str, str | int | float | Sequence[str]] = {
            "gen_ai.request.id": spec.request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": trace.n,
            "gen_ai.usage.prompt_tokens": len(spec.prompt_token_ids),
            "kvasir.tenant": trace.tenant_id,
        }
        if spec.parent_id is not None:
            attributes["kvasir.request.parent_id"] = spec.parent_id
        if prompt is not None:
            attributes["gen_ai.prompt"] = prompt
        start = trace.start_ns
        end = time.time_ns()
        phases: list[tuple[str, int, int]] = []
        if out is not None:
            attributes["gen_ai.usage.completion_tokens"] = out.num_output_tokens
            attributes["gen_ai.response.finish_reasons"] = [out.finish_reason or "abort"]
            attributes["kvasir.usage.cached_tokens"] = out.num_cached_tokens
            t = out.timings
            if t is not None:
                attributes.update({
                    "gen_ai.latency.time_in_queue": t.queue_seconds,
                    "gen_ai.latency.time_to_first_token": t.queue_seconds + t.prefill_seconds,
                    "gen_ai.latency.time_in_model_prefill": t.prefill_seconds,
                    "gen_ai.latency.time_in_model_decode": t.decode_seconds,
                    "gen_ai.latency.e2e": t.e2e_seconds})
                queued = start + int(t.queue_seconds * _NS)
                prefilled = queued + int(t.prefill_seconds * _NS)
                end = start + int(t.e2e_seconds * _NS)
                phases = [("queue", start, queued), ("prefill", queued, prefilled),
                          ("decode", prefilled, end)]
        else:
            attributes["gen_ai.response.finish_reasons"] = ["abort"]
        span = self.tracer.start_span(SPAN_NAME, context=trace.parent, kind=SpanKind.SERVER,
                                      attributes=attributes, start_time=start)
        if out is not None and out.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, "the engine could not run the request"))
        if phases and span.is_recording():
            inside = set_span_in_context(span)
            for name, begin, finish in phases:
                self.tracer.start_span(name, context=inside, start_time=begin).end(finish)
        span.end(end)


def build_request_tracer(config: TracingConfig, model_name: str,
                         exporter: SpanExporter | None = None) -> RequestTracer | None:
    provider = build_provider(config, exporter)
    if provider is None:
        return None
    return RequestTracer(provider, model_name, config.otlp_traces_include_prompt)
