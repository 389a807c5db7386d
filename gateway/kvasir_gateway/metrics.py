"""The gateway's Prometheus series, in one registry per app (several apps share a test process).

Per-tenant series carry a `tenant` label bounded by `--max-tenant-labels`: the first tenants seen
keep their name, later ones are counted as "other", so a flood of keys cannot blow up the series
count. Replicas are not a label (EndpointSlices churn); routing reasons and outcomes are small
fixed sets. The routing series (alias, rule, model, check) take their values from the
routing file only, so they are bounded by it too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OTHER_TENANT = "other"


class GatewayMetrics:
    def __init__(self, max_tenant_labels: int = 100) -> None:
        self.registry = CollectorRegistry()
        self.max_tenant_labels = max_tenant_labels
        self._tenants: set[str] = set()
        r = self.registry
        self.requests = Counter("kvasir_gateway_requests", "Requests answered, by status code",
                                ["tenant", "code"], registry=r)
        self.tokens_admitted = Counter(
            "kvasir_gateway_tokens_admitted", "Tokens of admitted requests (prompt + completion "
            "as the engine's usage reported, else the reservation)", ["tenant"], registry=r)
        self.tokens_refused = Counter("kvasir_gateway_tokens_refused",
                                      "Tokens (reservations) of refused requests",
                                      ["tenant", "limit"], registry=r)
        self.quota_remaining = Gauge("kvasir_gateway_quota_remaining_tokens",
                                     "Tokens left in the tenant's minute window at its last admission",
                                     ["tenant"], registry=r)
        self.quota_store_errors = Counter(
            "kvasir_gateway_quota_store_errors", "Quota store (Redis) calls that failed, by what "
            "the gateway did (fail_open, fail_closed, settle)", ["action"], registry=r)
        self.routing = Counter("kvasir_gateway_routing_decisions",
                               "Replica choices by reason (prefix, moved, new, least_load, "
                               "retry)", ["reason"], registry=r)
        self.prefix_hit = Histogram(
            "kvasir_gateway_prefix_hit_estimate", "Estimated fraction of the prompt's leading "
            "blocks already sent to the chosen replica", registry=r,
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
        self.precise_fallbacks = Counter(
            "kvasir_gateway_precise_fallbacks", "Precise routing decisions made approximately "
            "instead (reason: no_report, timeout, refused, error)", ["reason"], registry=r)
        self.disaggregation = Counter(
            "kvasir_gateway_disaggregation_requests", "Requests to pools with prefill and "
            "decode replicas, by where the prompt was computed (path: remote, local) and why "
            "(reason: prefill; short, queue, forced, unsupported, no_prefill, prefill_failed)",
            ["path", "reason"], registry=r)
        self.upstream_first_byte = Histogram(
            "kvasir_gateway_upstream_first_byte_seconds",
            "From sending to a replica until its response headers", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.upstream_latency = Histogram(
            "kvasir_gateway_upstream_latency_seconds", "Whole upstream exchange", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.upstream_errors = Counter("kvasir_gateway_upstream_errors",
                                       "Failed upstream attempts (connect, timeout, 5xx)",
                                       ["kind"], registry=r)
        self.in_flight = Gauge("kvasir_gateway_in_flight_requests",
                               "Requests being proxied now", registry=r)
        self.replicas = Gauge("kvasir_gateway_replicas", "Known replicas by state",
                              ["state"], registry=r)
        self.key_reloads = Counter("kvasir_gateway_key_reloads", "Key file reloads", registry=r)
        self.routing_reloads = Counter(
            "kvasir_gateway_routing_reloads", "Routing file versions seen after start "
            "(outcome: ok, error = refused, the previous table kept)", ["outcome"], registry=r)
        self.pool_requests = Counter(
            "kvasir_gateway_pool_requests", "Requests to an alias by the rule that chose and "
            "the pool (model) that answered", ["alias", "rule", "model"], registry=r)
        self.escalations = Counter(
            "kvasir_gateway_cascade_escalations", "Cascade answers that failed a check and went "
            "to the next pool (check: length, refusal, regex, json_schema, logprob, error, "
            "empty)", ["alias", "model", "check"], registry=r)
        self.escalation_added = Histogram(
            "kvasir_gateway_cascade_escalation_added_seconds", "Latency the failed attempts "
            "added to an escalated request", ["alias"], registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.shadow_comparisons = Counter(
            "kvasir_gateway_shadow_comparisons", "Shadowed answers compared with the reference "
            "pool's (outcome: agree, disagree)", ["alias", "rule", "outcome"], registry=r)
        self.shadow_tenant_comparisons = Counter(
            "kvasir_gateway_shadow_tenant_comparisons", "Shadowed answers compared, per tenant "
            "(bounded by --max-tenant-labels; outcome: agree, disagree)",
            ["alias", "tenant", "outcome"], registry=r)
        self.shadow_dropped = Counter(
            "kvasir_gateway_shadow_dropped", "Shadows not compared (reason: over_bound, error)",
            ["alias", "reason"], registry=r)
        self.shadow_similarity = Histogram(
            "kvasir_gateway_shadow_similarity", "Similarity of a shadowed answer to the "
            "reference (1: identical)", ["alias"], registry=r,
            buckets=(0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0))
        self.cascade_cost = Counter(
            "kvasir_gateway_cascade_cost", "Cost of alias requests' output tokens at the pools' "
            "cost per token (kind: actual, always_large = the reference pool for the same "
            "tokens)", ["alias", "kind"], registry=r)

    def tenant_label(self, tenant: str) -> str:
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self.max_tenant_labels:
            self._tenants.add(tenant)
            return tenant
        return OTHER_TENANT
