"""HTTP request metrics, as vLLM's API server exports them.

vLLM instruments its FastAPI app with prometheus-fastapi-instrumentator's defaults; these are the
same five families, names, labels and buckets: `http_requests_total{handler, method, status}`
(status by class: "2xx", "4xx", "5xx"), `http_request_duration_seconds{handler, method}`,
`http_request_duration_highr_seconds`, `http_request_size_bytes{handler}` and
`http_response_size_bytes{handler}` (sizes from the Content-Length headers, 0 without one).
vLLM's overview dashboard reads its 5xx ratio and HTTP panels from them.

A small ASGI middleware of our own rather than that package: one dependency less, and it sits
outside every other middleware, so a 401 or a 413 refused before any route runs is counted too.
A request is timed until its last body byte is sent (a stream to its end), as the
instrumentator's default. `handler` is the path template of the route that serves the request,
"none" for a path no route serves. The probes, the scrape and the gateway's poll are left out,
as vLLM leaves out /metrics, /health, /load, /ping, /version and /server_info.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/ready", "/version",
                               "/kvasir/prefix-cache"})
UNTEMPLATED_HANDLER = "none"
# The instrumentator's defaults: few buckets by handler, many without labels.
LATENCY_LOWR_BUCKETS = (0.1, 0.5, 1.0)
LATENCY_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0,
                         3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests_total",
                                "Total number of requests by method, status and handler.",
                                ["method", "status", "handler"], registry=registry)
        self.request_size = Summary(
            "http_request_size_bytes",
            "Content length of incoming requests by handler. Only value of header is "
            "respected. Otherwise ignored. No percentile calculated.",
            ["handler"], registry=registry)
        self.response_size = Summary(
            "http_response_size_bytes",
            "Content length of outgoing responses by handler. Only value of header is "
            "respected. Otherwise ignored. No percentile calculated.",
            ["handler"], registry=registry)
        self.duration_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate "
            "percentile calculations.", buckets=LATENCY_HIGHR_BUCKETS, registry=registry)
        self.duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by "
            "handler is important.", ["method", "handler"], buckets=LATENCY_LOWR_BUCKETS,
            registry=registry)

    def observe(self, handler: str, method: str, status: int, request_size: int,
                response_size: int, seconds: float) -> None:
        self.requests.labels(method=method, status=f"{status // 100}xx", handler=handler).inc()
        self.request_size.labels(handler=handler).observe(request_size)
        self.response_size.labels(handler=handler).observe(response_size)
        self.duration_highr.observe(seconds)
        self.duration.labels(method=method, handler=handler).observe(seconds)


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: HttpMetrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the app's own list: routes added later are seen too

    def handler(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return str(getattr(route, "path", UNTEMPLATED_HANDLER))
        return UNTEMPLATED_HANDLER

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = self.handler(scope)
        if handler in EXCLUDED_HANDLERS:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets when the app raises before answering
        response_size = 0

        async def send_and_watch(message: Message) -> None:
            nonlocal status, response_size
            if message["type"] == "http.response.start":
                status = message["status"]
                response_size = _content_length(message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            self.metrics.observe(handler, scope["method"], status,
                                 _content_length(scope.get("headers", ())), response_size,
                                 time.perf_counter() - start)


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return max(0, int(value))
            except ValueError:
                return 0
    return 0
