"""OpenTelemetry traces of proxied requests, off unless `--otlp-traces-endpoint` is set.

A `gateway.request` span per request (the child of a client's W3C `traceparent` when it sent
one) with children `gateway.auth`, `gateway.quota`, `gateway.route` (the policy and the replica
it chose) and one `gateway.attempt` per upstream send (pool, replica, status), whose
`traceparent` goes upstream so the engine's `llm_request` span is that attempt's child. No
prompt text: the gateway's spans hold names, counts and statuses only.

The spans nest through OpenTelemetry's context (a contextvar of the request's task), so the
request path passes nothing down but the `Tracer` the context holds. When tracing is off that
tracer is None: `span` hands back one shared null context and `inject` returns at once, so a
request costs a check. The provider is the app's own, never the process-global one.

This builds the provider as the engine's `server/tracing.py` does (the gateway imports nothing of
the engine: separate images): the same flags, the same environment, the same sampler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, MutableMapping
from contextlib import AbstractContextManager

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

OTLP_PROTOCOLS = ("grpc", "http/protobuf")  # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
_PROPAGATOR = TraceContextTextMapPropagator()
_OFF: AbstractContextManager[None] = contextlib.nullcontext()  # reusable, holds nothing


def otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )
    return HttpSpanExporter(endpoint=endpoint)


def build_provider(endpoint: str | None, protocol: str, sample_ratio: float | None,
                   service_name: str, exporter: SpanExporter | None = None
                   ) -> TracerProvider | None:
    """The app's provider, or None when no endpoint is set. `sample_ratio` keeps that share of
    root traces (a client's sampled flag wins); None: OTEL_TRACES_SAMPLER, else all. `exporter`
    replaces the OTLP one (tests)."""
    if endpoint is None:
        return None
    sampler: Sampler | None = None
    if sample_ratio is not None:
        sampler = ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(sampler=sampler,
                              resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter or otlp_exporter(endpoint, protocol)))
    return provider


def span(tracer: Tracer | None, name: str, kind: SpanKind = SpanKind.INTERNAL,
         context: Context | None = None) -> AbstractContextManager[Span | None]:
    """A child of the current span, current inside the block; the shared null context (None)
    when tracing is off. An exception leaving the block marks the span as an error."""
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(name, context=context, kind=kind)


def parent_context(headers: Mapping[str, str]) -> Context:
    """The client's span from its `traceparent`; an empty context without one."""
    return _PROPAGATOR.extract(carrier=headers)


def inject(tracer: Tracer | None, headers: MutableMapping[str, str]) -> None:
    """Adds the current span's `traceparent` (and `tracestate`) to upstream headers."""
    if tracer is not None:
        _PROPAGATOR.inject(headers)
