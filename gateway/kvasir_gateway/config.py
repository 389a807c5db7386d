"""One frozen `GatewayConfig`, validated once, parsed from the command line and environment.

Every limit of a tenant is a `QuotaLimits`; `--quota TENANT=tpm:N,rpm:N,concurrent:N` overrides
the defaults (`--tokens-per-minute`, `--requests-per-minute`, `--max-concurrent`) for one tenant.
A limit of 0 means unlimited. Errors name the flag; the few fields no flag sets (`lease_seconds`,
`chars_per_token`, `prefix_block_chars`, `prefix_max_blocks`, ...) are named as fields.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvasir_gateway.aliases import RoutingTable, load_routing_file
from kvasir_gateway.disaggregation import DisaggregationMode
from kvasir_gateway.router import Costs, RoutingPolicy
from kvasir_gateway.tracing import OTLP_PROTOCOLS

# What a tenant name may be: the engine's rule, so that the names we forward are accepted there.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_NAME_RULE = "1-64 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
ANONYMOUS_TENANT = "anonymous"
ROUTING_POLICIES = tuple(policy.value for policy in RoutingPolicy)
DISAGGREGATION_MODES = tuple(mode.value for mode in DisaggregationMode)
_QUOTA_FIELDS = {"tpm": "tokens_per_minute", "rpm": "requests_per_minute",
                 "concurrent": "max_concurrent"}


def is_tenant_name(name: str) -> bool:
    return TENANT_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class QuotaLimits:
    tokens_per_minute: int = 0  # prompt + completion tokens; 0 = unlimited
    requests_per_minute: int = 0
    max_concurrent: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens_per_minute", "requests_per_minute", "max_concurrent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def is_unlimited(self) -> bool:
        return not (self.tokens_per_minute or self.requests_per_minute or self.max_concurrent)


@dataclass(frozen=True)
class EndpointSliceSource:
    namespace: str
    service: str
    port: int | None = None  # None: the slice's first port


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    backends: tuple[str, ...] = ()  # static replica base URLs
    endpoint_slices: tuple[EndpointSliceSource, ...] = ()
    kube_api_server: str | None = None  # an API server without credentials; None: in-cluster
    api_key_file: str | None = None  # `tenant:key` lines (the engine's --api-key-file format)
    key_reload_seconds: float = 2.0  # how often the key file's mtime is checked
    upstream_key: str | None = None  # the trusted-gateway key the engines accept
    default_limits: QuotaLimits = QuotaLimits()
    tenant_limits: Mapping[str, QuotaLimits] = field(default_factory=dict)
    redis_url: str | None = None  # None: the in-process store (one gateway replica)
    redis_timeout_seconds: float = 0.25
    redis_fail_open: bool = True  # Redis unreachable: admit (True) or refuse with 503
    lease_seconds: float = 600.0  # a concurrency slot a crashed gateway left expires after this
    default_max_tokens: int = 1024  # reserved when a request names no max_tokens
    chars_per_token: float = 4.0  # prompt-size estimate at admission (no tokenizer here)
    max_body_bytes: int = 4 * 1024 * 1024
    prefix_block_chars: int = 256  # one routing block of the prompt's leading text
    prefix_max_blocks: int = 64
    prefix_index_entries: int = 200_000  # recent block hash -> replica, LRU
    # CHWBL epsilon, the hard guard: no replica above (1 + eps) x mean load (router.py); 0.6 keeps
    # the busiest replica within 1.25x the mean at 0.90-0.96 of an oracle's cache hits
    # (docs/gateway.md, "Choosing --load-bound")
    load_bound: float = 0.6
    # router.py's work score, in prompt tokens: a miss's tokens count this many times (computed
    # now, and what they evict is computed again later); a request in flight costs this many
    prefix_miss_weight: float = Costs.miss_weight
    load_tokens_per_request: float = Costs.tokens_per_request
    # "prefix" (approximate: where we sent each prefix), "precise" (what the engines report
    # holding, precise.py); "least_load" and "round_robin" are there to compare against (bench).
    # A name is accepted too, and held as its `RoutingPolicy`.
    routing: RoutingPolicy = RoutingPolicy.PREFIX
    prefix_hash_timeout_seconds: float = 1.0  # precise: asking a replica for the hashes
    # precise: a prefix sent to a replica counts this long before the engine must report it
    prefix_pending_seconds: float = 10.0
    # Pools whose engines report KV-transfer roles (disaggregation.py): "auto" prefills a prompt
    # on a prefill replica unless it is short or the prefill pool's queue is longer than it;
    # "always", "never". A name is accepted too, and held as its `DisaggregationMode`.
    disaggregation: DisaggregationMode = DisaggregationMode.AUTO
    # Below this many (estimated) prompt tokens the decode replica computes the prompt: the
    # decode stage a remote prefill adds (~27 ms + 0.03 ms a token) costs more than the prefill
    # it spares the decode replica (~0.3 ms a token): break-even about 120 tokens with the
    # default model on a 2-core CPU host (docs/gateway.md, "Choosing the threshold"; raise it
    # on GPUs).
    disaggregation_min_prompt_tokens: int = 128
    # The prefill stage's whole call; past it the decode replica computes the prompt itself.
    disaggregation_prefill_timeout_seconds: float = 30.0
    probe_interval_seconds: float = 1.0  # /ready, /metrics and /v1/models of each replica
    probe_timeout_seconds: float = 2.0
    probe_failure_threshold: int = 3  # failed probes in a row before a replica is unready
    eject_seconds: float = 5.0  # a replica whose connection failed waits this long
    connect_timeout_seconds: float = 2.0
    max_attempts: int = 3  # replicas tried before the first byte reached the client
    max_tenant_labels: int = 100  # distinct tenant label values; later ones count as "other"
    # aliases, their rules, cascades and shadows, and the pools' prices (--routing-file)
    routing_table: RoutingTable = RoutingTable()
    routing_file: str | None = None  # where routing_table came from; reloaded when it changes
    log_level: str = "info"
    # OpenTelemetry traces (tracing.py): the OTLP endpoint, None: off; the exporter's protocol
    # (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); the share of root traces kept, None: the SDK's
    # OTEL_TRACES_SAMPLER, else all; the service name (OTEL_SERVICE_NAME).
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = "grpc"
    otlp_traces_sample_ratio: float | None = None
    service_name: str = "kvasir-gateway"

    def __post_init__(self) -> None:
        checks = [
            (0 < self.port < 65536 or self.port == 0, f"--port must be 0-65535, got {self.port}"),
            (self.redis_timeout_seconds > 0, "--redis-timeout must be > 0"),
            (self.lease_seconds > 0, "lease_seconds must be > 0"),
            (self.default_max_tokens > 0, "--default-max-tokens must be > 0"),
            (self.chars_per_token > 0, "chars_per_token must be > 0"),
            (self.max_body_bytes > 0, "--max-body-bytes must be > 0"),
            (self.prefix_block_chars > 0, "prefix_block_chars must be > 0"),
            (self.prefix_max_blocks > 0, "prefix_max_blocks must be > 0"),
            (self.load_bound > 0, f"--load-bound must be > 0, got {self.load_bound}"),
            (self.prefix_miss_weight >= 0,
             f"--prefix-miss-weight must be >= 0, got {self.prefix_miss_weight}"),
            (self.load_tokens_per_request >= 0,
             f"--load-tokens-per-request must be >= 0, got {self.load_tokens_per_request}"),
            (self.routing in ROUTING_POLICIES,
             f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}"),
            (self.disaggregation in DISAGGREGATION_MODES,
             f"--disaggregation must be one of {', '.join(DISAGGREGATION_MODES)}, "
             f"got {self.disaggregation!r}"),
            (self.disaggregation_min_prompt_tokens >= 0,
             f"--disaggregation-min-prompt-tokens must be >= 0, "
             f"got {self.disaggregation_min_prompt_tokens}"),
            (self.disaggregation_prefill_timeout_seconds > 0,
             "--disaggregation-prefill-timeout must be > 0"),
            (self.probe_interval_seconds > 0, "--probe-interval must be > 0"),
            (self.prefix_hash_timeout_seconds > 0, "--prefix-hash-timeout must be > 0"),
            (self.prefix_pending_seconds >= 0, "--prefix-pending-seconds must be >= 0"),
            (self.max_attempts >= 1, "--max-attempts must be >= 1"),
            (self.probe_timeout_seconds > 0, "--probe-timeout must be > 0"),
            (self.probe_failure_threshold >= 1, "--probe-failure-threshold must be >= 1"),
            (self.max_tenant_labels >= 0, "--max-tenant-labels must be >= 0"),
            (self.otlp_traces_sample_ratio is None or 0 <= self.otlp_traces_sample_ratio <= 1,
             f"--otlp-traces-sample-ratio must be in [0, 1], "
             f"got {self.otlp_traces_sample_ratio}"),
            (self.otlp_traces_protocol in OTLP_PROTOCOLS,
             f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of {', '.join(OTLP_PROTOCOLS)}, "
             f"got {self.otlp_traces_protocol!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        # The policy is decided here, once: a type from now on, never a string to test.
        object.__setattr__(self, "routing", RoutingPolicy(self.routing))
        object.__setattr__(self, "disaggregation", DisaggregationMode(self.disaggregation))
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--backend {url!r} must start with http:// or https://")
        for tenant in self.tenant_limits:
            if tenant != "*" and not is_tenant_name(tenant):
                raise ValueError(f"--quota tenant {tenant!r} is not {TENANT_NAME_RULE}")

    def limits_for(self, tenant: str) -> QuotaLimits:
        return self.tenant_limits.get(tenant, self.default_limits)


def parse_quota(text: str) -> tuple[str, QuotaLimits]:
    """`TENANT=tpm:N,rpm:N,concurrent:N` (any subset; the rest unlimited)."""
    tenant, sep, spec = text.partition("=")
    where = f"--quota {text!r}"
    if not sep or not tenant.strip():
        raise ValueError(f"{where}: expected TENANT=tpm:N,rpm:N,concurrent:N")
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, colon, number = item.partition(":")
        if not colon or key not in _QUOTA_FIELDS:
            raise ValueError(f"{where}: {item!r} is not one of tpm:N, rpm:N, concurrent:N")
        try:
            values[_QUOTA_FIELDS[key]] = int(number)
        except ValueError:
            raise ValueError(f"{where}: {key} needs an integer, got {number!r}") from None
    try:
        return tenant.strip(), QuotaLimits(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def parse_endpoint_slice(text: str) -> EndpointSliceSource:
    """`NAMESPACE/SERVICE[:PORT]`."""
    ref, _, port = text.partition(":")
    namespace, slash, service = ref.partition("/")
    if not slash or not namespace or not service:
        raise ValueError(f"--endpoint-slices {text!r}: expected NAMESPACE/SERVICE[:PORT]")
    if port and not port.isdigit():
        raise ValueError(f"--endpoint-slices {text!r}: port must be a number")
    return EndpointSliceSource(namespace, service, int(port) if port else None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvasir-gateway", description=__doc__)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="an engine replica's base URL (repeatable; local use)")
    p.add_argument("--endpoint-slices", action="append", default=[],
                   metavar="NAMESPACE/SERVICE[:PORT]",
                   help="watch this Service's EndpointSlices for ready replicas (repeatable)")
    p.add_argument("--kube-api-server", default=None, metavar="URL",
                   help="API server that needs no credentials (local emulators); default: the "
                        "in-cluster service account, else the kubeconfig")
    p.add_argument("--api-key-file", default=os.environ.get("KVASIR_GATEWAY_API_KEY_FILE"),
                   help="'tenant:key' lines (the engine's format); reloaded when it changes")
    p.add_argument("--upstream-key-file",
                   default=os.environ.get("KVASIR_GATEWAY_UPSTREAM_KEY_FILE"),
                   help="file holding the trusted-gateway key sent to the engines "
                        "(env KVASIR_GATEWAY_UPSTREAM_KEY holds the key itself)")
    p.add_argument("--tokens-per-minute", type=int, default=0, help="default tenant TPM (0: none)")
    p.add_argument("--requests-per-minute", type=int, default=0)
    p.add_argument("--max-concurrent", type=int, default=0)
    p.add_argument("--quota", action="append", default=[], metavar="TENANT=tpm:N,rpm:N,concurrent:N")
    p.add_argument("--redis-url", default=os.environ.get("KVASIR_GATEWAY_REDIS_URL"))
    p.add_argument("--redis-timeout", type=float, default=0.25, metavar="SECONDS")
    p.add_argument("--redis-failure", choices=("open", "closed"), default="open",
                   help="when Redis is unreachable: admit (open) or answer 503 (closed)")
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--load-bound", type=float, default=GatewayConfig.load_bound, metavar="EPS",
                   help="routing's hard guard: no replica above ceil((1 + EPS) x mean load)")
    p.add_argument("--prefix-miss-weight", type=float, default=GatewayConfig.prefix_miss_weight,
                   metavar="W",
                   help="routing: a prompt token the replica does not hold counts W tokens of work")
    p.add_argument("--load-tokens-per-request", type=float,
                   default=GatewayConfig.load_tokens_per_request, metavar="N",
                   help="routing: a request in flight on a replica counts N tokens of work")
    p.add_argument("--routing", choices=ROUTING_POLICIES, default="prefix",
                   help="prefix (approximate prefix- and load-aware, bounded), precise (the same "
                        "from what the engines report their caches hold); the others for "
                        "comparison")
    p.add_argument("--prefix-hash-timeout", type=float, default=1.0, metavar="SECONDS",
                   help="precise routing: how long a replica may take to hash a prompt")
    p.add_argument("--prefix-pending-seconds", type=float, default=10.0, metavar="SECONDS",
                   help="precise routing: how long a prefix sent to a replica counts before "
                        "its engine reports it")
    p.add_argument("--disaggregation", choices=DISAGGREGATION_MODES, default="auto",
                   help="pools with prefill (kv_producer) and decode (kv_consumer) replicas: "
                        "auto (prefill remotely unless the prompt is short or the prefill "
                        "pool's queue is longer than it), always, never")
    p.add_argument("--disaggregation-min-prompt-tokens", type=int,
                   default=GatewayConfig.disaggregation_min_prompt_tokens, metavar="N",
                   help="auto: prompts of fewer (estimated) tokens are computed on the "
                        "decode replica")
    p.add_argument("--disaggregation-prefill-timeout", type=float,
                   default=GatewayConfig.disaggregation_prefill_timeout_seconds,
                   metavar="SECONDS",
                   help="the prefill stage's deadline; past it the decode replica computes "
                        "the prompt")
    p.add_argument("--probe-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--probe-timeout", type=float, default=2.0, metavar="SECONDS")
    p.add_argument("--probe-failure-threshold", type=int, default=3,
                   help="failed probes in a row before a replica counts as unready")
    p.add_argument("--eject-seconds", type=float, default=5.0)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--max-tenant-labels", type=int, default=100)
    p.add_argument("--routing-file", default=None, metavar="PATH",
                   help="YAML or JSON: model aliases (rules, cascades, shadows) and pool prices "
                        "(docs/gateway.md, 'Model routing')")
    p.add_argument("--log-level", default="info")
    p.add_argument("--otlp-traces-endpoint",
                   default=(os.environ.get("KVASIR_GATEWAY_OTLP_TRACES_ENDPOINT")
                            or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")),
                   metavar="URL",
                   help="send OpenTelemetry traces (a gateway.request span per request, its "
                        "attempts' traceparent sent upstream) to this OTLP endpoint; off when "
                        "unset (env KVASIR_GATEWAY_OTLP_TRACES_ENDPOINT, else "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    p.add_argument("--otlp-traces-sample-ratio", type=float,
                   default=os.environ.get("KVASIR_GATEWAY_OTLP_TRACES_SAMPLE_RATIO"),
                   metavar="RATIO",
                   help="share of root traces kept, in [0, 1]; a client's traceparent decides "
                        "for its own; unset: OTEL_TRACES_SAMPLER, else all "
                        "(env KVASIR_GATEWAY_OTLP_TRACES_SAMPLE_RATIO)")
    return p


def config_from_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    args = build_parser().parse_args(argv)
    upstream_key = os.environ.get("KVASIR_GATEWAY_UPSTREAM_KEY") or None
    if args.upstream_key_file:
        with open(args.upstream_key_file, encoding="utf-8") as f:
            upstream_key = f.read().strip() or None
    default = QuotaLimits(args.tokens_per_minute, args.requests_per_minute, args.max_concurrent)
    return GatewayConfig(
        host=args.host, port=args.port, backends=tuple(args.backend),
        endpoint_slices=tuple(parse_endpoint_slice(s) for s in args.endpoint_slices),
        kube_api_server=args.kube_api_server,
        api_key_file=args.api_key_file, upstream_key=upstream_key, default_limits=default,
        tenant_limits=dict(parse_quota(q) for q in args.quota), redis_url=args.redis_url,
        redis_timeout_seconds=args.redis_timeout, redis_fail_open=args.redis_failure == "open",
        default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
        load_bound=args.load_bound, prefix_miss_weight=args.prefix_miss_weight,
        load_tokens_per_request=args.load_tokens_per_request,
        routing=RoutingPolicy(args.routing),
        prefix_hash_timeout_seconds=args.prefix_hash_timeout,
        prefix_pending_seconds=args.prefix_pending_seconds,
        disaggregation=DisaggregationMode(args.disaggregation),
        disaggregation_min_prompt_tokens=args.disaggregation_min_prompt_tokens,
        disaggregation_prefill_timeout_seconds=args.disaggregation_prefill_timeout,
        probe_interval_seconds=args.probe_interval, probe_timeout_seconds=args.probe_timeout,
        probe_failure_threshold=args.probe_failure_threshold,
        eject_seconds=args.eject_seconds, max_attempts=args.max_attempts,
        max_tenant_labels=args.max_tenant_labels,
        routing_table=load_routing_file(args.routing_file) if args.routing_file
        else RoutingTable(), routing_file=args.routing_file, log_level=args.log_level,
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
        otlp_traces_protocol=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
        otlp_traces_sample_ratio=(None if args.otlp_traces_sample_ratio is None
                                  else float(args.otlp_traces_sample_ratio)),
        service_name=os.environ.get("OTEL_SERVICE_NAME") or "kvasir-gateway")
