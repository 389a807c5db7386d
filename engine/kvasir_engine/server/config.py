"""`ServerConfig`: the HTTP side of `kvasir-engine serve`, frozen and validated once.

The engine flags (model, cache, scheduler) live in `args.py`; this module adds the flags only the
server needs. Each gets its `KVASIR_*` environment fallback from `args.apply_env_defaults`, so a
container can be configured without a command line and a bad value fails, naming the flag, before
the port opens.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from kvasir_engine.server.tenants import (
    TenantKey,
    merge_keys,
    parse_key_entry,
    parse_key_lines,
    parse_shared_groups,
)
from kvasir_engine.server.tracing import TracingConfig

# Sequences (prompts x n) one request may ask for: a batch of a few hundred prompts passes, a
# 3 KB body of 500 prompts x n=16 (8000 sequences) does not.
DEFAULT_MAX_REQUEST_SEQUENCES = 256
# Distinct `tenant` label values of the kvasir:tenant_* series; later tenants count as "other".
DEFAULT_MAX_TENANT_METRIC_LABELS = 100
GATEWAY_KEY_TENANT = "gateway"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ServerConfig:
    # vLLM's default, so a pod is reachable without flags; `make serve` passes 127.0.0.1.
    host: str = "0.0.0.0"
    port: int = 8000
    # The accepted keys as (tenant, sha256); none = no authentication, one anonymous tenant.
    # Plain strings (programmatic use, tests) are parsed as `tenant:key` / bare-key entries.
    api_keys: tuple[TenantKey, ...] = ()
    # Keys the names of bare keys' tenants (tenants.bare_key_tenant); random unless given, so
    # those names (metric labels) then change at each start: name tenants for stable labels.
    tenant_label_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32),
                                       repr=False, compare=False)
    # When set, /metrics answers only `Authorization: Bearer <token>` (Prometheus'
    # bearer_token); None: open, as kubelet probes and most scrapers expect.
    metrics_token: str | None = field(default=None, repr=False)
    # Keys of a trusted gateway: requests with one may name their tenant (x-kvasir-tenant).
    trusted_gateway_keys: tuple[TenantKey, ...] = ()
    # Groups of tenants whose prompts share prefix-cache blocks (one salt per group).
    prefix_cache_shared_tenants: tuple[frozenset[str], ...] = ()
    max_request_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES
    # Waiting sequences one tenant may hold beyond the running slots it could take; None = fair
    # by default: half the admitted total with several tenants, else the global queue alone.
    max_waiting_seqs_per_tenant: int | None = None
    max_tenant_metric_labels: int = DEFAULT_MAX_TENANT_METRIC_LABELS
    # Largest accepted request body; 8 MiB holds a 128k-token prompt as token ids.
    max_body_bytes: int = 8 * 1024 * 1024
    # A connection's request line and headers must be in within this long (connections.py),
    # its body within this long after them (body_limit.py); an idle kept-alive connection is
    # closed after this long (uvicorn's timeout_keep_alive, whose default it keeps).
    request_header_timeout_seconds: float = 10.0
    request_body_timeout_seconds: float = 30.0
    keep_alive_timeout_seconds: int = 5
    max_n: int = 16
    # Prompts and completions are logged only when asked (they may hold personal data).
    log_requests: bool = False
    shutdown_grace_seconds: float = 30.0
    # A /ready probe waits at most this long for a token-producing step. Keep it below the
    # kubelet probe's timeoutSeconds, so the engine answers 503 with a reason before kubelet gives up.
    ready_timeout_seconds: float = 10.0
    # /ready answers at once (no step awaited) when a step produced tokens this recently; a
    # busy engine then answers in milliseconds, and a frozen one fails after this long.
    ready_recent_seconds: float = 5.0
    # /health fails when work is queued and no step finished for this long.
    health_stall_seconds: float = 30.0
    # Told to a client refused with 429 (queue full).
    retry_after_seconds: int = 1
    # Run a short generation before the first 200 from /ready (compiles, allocates, warms caches).
    warmup: bool = True
    # OpenTelemetry traces (tracing.py); off unless an endpoint is set.
    tracing: TracingConfig = field(default_factory=TracingConfig)

    @property
    def is_multi_tenant(self) -> bool:
        """Whether requests of several tenants can arrive: two or more API-key tenants, or a
        trusted gateway that names them."""
        return bool(self.trusted_gateway_keys) or len({k.tenant_id for k in self.api_keys}) > 1

    def __post_init__(self) -> None:
        _require(bool(self.host), "--host must not be empty")
        _require(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        for name in ("api_keys", "trusted_gateway_keys"):
            given = getattr(self, name)
            if any(isinstance(k, str) for k in given):
                object.__setattr__(self, name, merge_keys(
                    (f"{name}:{i}", parse_key_entry(k, f"{name}:{i}", self.tenant_label_secret)
                     if isinstance(k, str)
                     else k) for i, k in enumerate(given, start=1)))
        _require(self.max_request_sequences >= 1,
                 f"--max-request-sequences must be >= 1, got {self.max_request_sequences}")
        _require(self.max_waiting_seqs_per_tenant is None or self.max_waiting_seqs_per_tenant >= 0,
                 f"--max-waiting-seqs-per-tenant must be >= 0, "
                 f"got {self.max_waiting_seqs_per_tenant}")
        _require(self.max_tenant_metric_labels >= 0,
                 f"--max-tenant-metric-labels must be >= 0, got {self.max_tenant_metric_labels}")
        _require(self.max_body_bytes >= 1024,
                 f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        _require(self.max_n >= 1, f"--max-n must be >= 1, got {self.max_n}")
        for name, value in (("--shutdown-grace-seconds", self.shutdown_grace_seconds),
                            ("--ready-timeout-seconds", self.ready_timeout_seconds),
                            ("--ready-recent-seconds", self.ready_recent_seconds),
                            ("--health-stall-seconds", self.health_stall_seconds),
                            ("--request-header-timeout", self.request_header_timeout_seconds),
                            ("--request-body-timeout", self.request_body_timeout_seconds),
                            ("--keep-alive-timeout", self.keep_alive_timeout_seconds)):
            _require(math.isfinite(value) and value > 0, f"{name} must be > 0, got {value}")
        _require(self.retry_after_seconds >= 1,
                 f"retry_after_seconds must be >= 1, got {self.retry_after_seconds}")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Adds the server flags to `serve`'s parser.

    `args.apply_env_defaults` then gives each one its `KVASIR_<FLAG>` fallback; keys also come
    from `KVASIR_API_KEYS` (comma-separated), read in `server_config_from_args`.
    """
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to bind (KVASIR_HOST)")
    g.add_argument("--port", type=int, default=d.port, help="(KVASIR_PORT)")
    g.add_argument("--api-key", action="append", default=None, metavar="[TENANT:]KEY",
                   help="accepted bearer key, optionally with its tenant; a bare key is its "
                        "own tenant; repeatable (KVASIR_API_KEYS: comma-separated)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file with one 'tenant:key' (or bare key) per line; '#' comments "
                        "(KVASIR_API_KEY_FILE)")
    g.add_argument("--trusted-gateway-key-file", default=None, metavar="PATH",
                   help="keys of a trusted gateway, one per line: requests with one may name "
                        "their tenant in x-kvasir-tenant (KVASIR_TRUSTED_GATEWAY_KEY_FILE)")
    g.add_argument("--prefix-cache-shared-tenants", action="append", default=None,
                   metavar="A,B[,...]",
                   help="tenants that share prefix-cache blocks (isolated by default); "
                        "repeatable, one group each (KVASIR_PREFIX_CACHE_SHARED_TENANTS: "
                        "groups separated by ';')")
    g.add_argument("--tenant-label-secret", default=None, metavar="SECRET",
                   help="keys the metric/log name of a bare API key's tenant (an HMAC); "
                        "random per start when unset (KVASIR_TENANT_LABEL_SECRET)")
    g.add_argument("--metrics-token", default=None, metavar="TOKEN",
                   help="/metrics then requires 'Authorization: Bearer TOKEN'; open when "
                        "unset (KVASIR_METRICS_TOKEN)")
    g.add_argument("--max-request-sequences", type=int, default=d.max_request_sequences,
                   help="largest prompts x n of one request (KVASIR_MAX_REQUEST_SEQUENCES)")
    g.add_argument("--max-waiting-seqs-per-tenant", type=int, default=None,
                   help="waiting sequences one tenant may hold beyond its running slots; "
                        "unset: half of running + queue when several tenants have keys, "
                        "else unbounded (KVASIR_MAX_WAITING_SEQS_PER_TENANT)")
    g.add_argument("--max-tenant-metric-labels", type=int, default=d.max_tenant_metric_labels,
                   help="distinct tenant labels in kvasir:tenant_* metrics; the rest are "
                        "'other' (KVASIR_MAX_TENANT_METRIC_LABELS)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="larger request bodies get 413 (KVASIR_MAX_BODY_BYTES)")
    g.add_argument("--request-header-timeout", type=float,
                   default=d.request_header_timeout_seconds, metavar="SECONDS",
                   help="a request's line and headers must arrive within this long, else 408 "
                        "and the connection closes (KVASIR_REQUEST_HEADER_TIMEOUT)")
    g.add_argument("--request-body-timeout", type=float,
                   default=d.request_body_timeout_seconds, metavar="SECONDS",
                   help="a request's body must arrive within this long after its headers, "
                        "else 408 (KVASIR_REQUEST_BODY_TIMEOUT)")
    g.add_argument("--keep-alive-timeout", type=int, default=d.keep_alive_timeout_seconds,
                   metavar="SECONDS",
                   help="an idle kept-alive connection is closed after this long "
                        "(uvicorn's timeout_keep_alive; KVASIR_KEEP_ALIVE_TIMEOUT)")
    g.add_argument("--max-n", type=int, default=d.max_n,
                   help="largest accepted `n` (KVASIR_MAX_N)")
    g.add_argument("--log-requests", action="store_true", default=False,
                   help="log prompts and completions (KVASIR_LOG_REQUESTS)")
    g.add_argument("--shutdown-grace-seconds", type=float,
                   default=d.shutdown_grace_seconds,
                   help="on SIGTERM, in-flight requests get this long (KVASIR_SHUTDOWN_GRACE_SECONDS)")
    g.add_argument("--ready-timeout-seconds", type=float,
                   default=d.ready_timeout_seconds,
                   help="bound of one /ready probe (KVASIR_READY_TIMEOUT_SECONDS)")
    g.add_argument("--ready-recent-seconds", type=float,
                   default=d.ready_recent_seconds,
                   help="/ready answers at once when a step produced tokens this recently "
                        "(KVASIR_READY_RECENT_SECONDS)")
    g.add_argument("--health-stall-seconds", type=float,
                   default=d.health_stall_seconds,
                   help="/health fails when queued work saw no step for this long "
                        "(KVASIR_HEALTH_STALL_SECONDS)")
    g.add_argument("--no-warmup", action="store_true", default=False,
                   help="skip the warm-up generation (KVASIR_NO_WARMUP)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces (one llm_request span per request) to this "
                        "OTLP endpoint; off when unset (KVASIR_OTLP_TRACES_ENDPOINT, else "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
                        "grpc or http/protobuf)")
    g.add_argument("--otlp-traces-sample-ratio", type=float, default=None, metavar="RATIO",
                   help="share of root traces kept, in [0, 1]; a caller's traceparent decides "
                        "for its own; unset: OTEL_TRACES_SAMPLER, else all "
                        "(KVASIR_OTLP_TRACES_SAMPLE_RATIO)")
    g.add_argument("--otlp-traces-include-prompt", action="store_true", default=False,
                   help="put the prompt text in the spans (off: prompts may hold personal "
                        "data) (KVASIR_OTLP_TRACES_INCLUDE_PROMPT)")


def _read_key_file(flag: str, path: str, label_secret: bytes) -> list[tuple[str, TenantKey]]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
    entries = parse_key_lines(text, f"{flag} {path}", label_secret)
    if not entries:
        raise ValueError(f"{flag}: {path} holds no key")
    return entries


def _listed(given: list[str] | str | None, separator: str) -> list[str]:
    # A flag's environment fallback arrives as one string, the repeated flag as a list.
    items = given.split(separator) if isinstance(given, str) else list(given or [])
    return [item for item in items if item.strip()]


def server_config_from_args(ns: argparse.Namespace) -> ServerConfig:
    """Builds the frozen config; raises ValueError with the flag's name on a bad value."""
    secret = (ns.tenant_label_secret.encode("utf-8") if ns.tenant_label_secret
              else secrets.token_bytes(32))
    entries = [(f"--api-key:{i}", parse_key_entry(k, f"--api-key:{i}", secret))
               for i, k in enumerate(_listed(ns.api_key, ","), start=1)]
    entries += [(f"KVASIR_API_KEYS:{i}", parse_key_entry(k, f"KVASIR_API_KEYS:{i}", secret))
                for i, k in enumerate(_listed(os.environ.get("KVASIR_API_KEYS"), ","), start=1)]
    if ns.api_key_file:
        entries += _read_key_file("--api-key-file", ns.api_key_file, secret)
    gateway: tuple[TenantKey, ...] = ()
    if ns.trusted_gateway_key_file:
        gateway = merge_keys(
            (where, TenantKey(GATEWAY_KEY_TENANT, key.key_digest))
            for where, key in _read_key_file("--trusted-gateway-key-file",
                                             ns.trusted_gateway_key_file, secret))
    api_keys = merge_keys(entries)
    shared = {k.key_digest for k in api_keys} & {k.key_digest for k in gateway}
    if shared:
        raise ValueError("--trusted-gateway-key-file: a gateway key is also a tenant's API key")
    return ServerConfig(
        host=ns.host,
        port=ns.port,
        tenant_label_secret=secret,
        metrics_token=ns.metrics_token,
        api_keys=api_keys,
        trusted_gateway_keys=gateway,
        prefix_cache_shared_tenants=parse_shared_groups(
            _listed(ns.prefix_cache_shared_tenants, ";")),
        max_request_sequences=ns.max_request_sequences,
        max_waiting_seqs_per_tenant=ns.max_waiting_seqs_per_tenant,
        max_tenant_metric_labels=ns.max_tenant_metric_labels,
        max_body_bytes=ns.max_body_bytes,
        request_header_timeout_seconds=ns.request_header_timeout,
        request_body_timeout_seconds=ns.request_body_timeout,
        keep_alive_timeout_seconds=ns.keep_alive_timeout,
        max_n=ns.max_n,
        log_requests=ns.log_requests,
        shutdown_grace_seconds=ns.shutdown_grace_seconds,
        ready_timeout_seconds=ns.ready_timeout_seconds,
        ready_recent_seconds=ns.ready_recent_seconds,
        health_stall_seconds=ns.health_stall_seconds,
        warmup=not ns.no_warmup,
        tracing=tracing_config_from_args(ns),
    )


def tracing_config_from_args(ns: argparse.Namespace) -> TracingConfig:
    endpoint = ns.otlp_traces_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return TracingConfig(
        otlp_traces_endpoint=endpoint or None,
        otlp_traces_protocol=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
        otlp_traces_sample_ratio=ns.otlp_traces_sample_ratio,
        otlp_traces_include_prompt=ns.otlp_traces_include_prompt,
        service_name=os.environ.get("OTEL_SERVICE_NAME") or "kvasir-engine")
