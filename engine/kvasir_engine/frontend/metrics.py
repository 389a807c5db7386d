"""The engine server's Prometheus registry: vLLM's metrics, Kvasir's own, and the process's.

`vllm:` families (vllm_metrics.py) carry vLLM's names and labels, so existing vLLM dashboards,
KEDA recipes and the Gateway API Inference Extension read them unchanged; `kvasir:` ones are our
own (docs/metrics.md says what each measures); `process_*` and `python_*` are prometheus_client's
standard collectors, as on vLLM's server. Step-level series are fed from each step's
`SchedulerStats`; request-level series from the `RequestOutput`s a step returns. The registry is
private to the instance, so two servers in one process (tests) never share counters.

`kvasir:tenant_*` series carry a `tenant` label whose distinct values are capped
(`max_tenant_labels`): tenants beyond the cap, in order of first appearance, are counted under
`tenant="other"`, so a flood of gateway-named tenants cannot blow up Prometheus' memory.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from kvasir_engine.core.outputs import SchedulerStats
from kvasir_engine.frontend.engine_types import RequestSpec
from kvasir_engine.frontend.request_output import RequestOutput
from kvasir_engine.frontend.vllm_metrics import (
    REQUEST_LATENCY_BUCKETS,
    VllmMetrics,
    buckets_1_2_5,
)

OTHER_TENANTS_LABEL = "other"
TENANT_COUNTERS = {
    "requests": "Finished requests (sequences) of a tenant",
    "prompt_tokens": "Prefilled prompt tokens of a tenant",
    "generation_tokens": "Generated tokens of a tenant",
    "requests_refused": "HTTP requests of a tenant refused with 429 (a queue bound)",
}
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineMetrics:
    def __init__(self, model_name: str, max_model_len: int, max_num_seqs: int,
                 max_tenant_labels: int = 100, *, cache_info: Mapping[str, str] | None = None,
                 num_speculative_tokens: int = 0) -> None:
        """`cache_info`: the labels of vllm:cache_config_info (vLLM's CacheConfig names)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]
        self._model_name = model_name
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.vllm = VllmMetrics(r, model_name, max_model_len,
                                cache_info=cache_info or {"block_size": "16"},
                                num_speculative_tokens=num_speculative_tokens)
        self.step_duration = Histogram("kvasir:step_duration_seconds",
                                       "Wall time of one engine step", label,
                                       buckets=STEP_BUCKETS, registry=r).labels(model_name)
        self.batch_size = Histogram("kvasir:batch_size", "Requests scheduled in one step", label,
                                    buckets=buckets_1_2_5(max(max_num_seqs, 1)),
                                    registry=r).labels(model_name)
        self.scheduled_tokens = Histogram("kvasir:scheduled_tokens_per_step",
                                          "Tokens computed in one step", label,
                                          buckets=buckets_1_2_5(max(max_model_len, 1)),
                                          registry=r).labels(model_name)
        self.engine_steps = Counter("kvasir:engine_steps", "Engine steps run", label,
                                    registry=r).labels(model_name)
        # kvasir:tenant_<name>_total, label `tenant` besides `model_name`.
        self.tenant_counters = {name: Counter(f"kvasir:tenant_{name}", doc,
                                              ["model_name", "tenant"], registry=r)
                                for name, doc in TENANT_COUNTERS.items()}
        self.tenant_queue_time = Histogram("kvasir:tenant_request_queue_time_seconds",
                                           "Time a tenant's requests waited to start",
                                           ["model_name", "tenant"],
                                           buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.max_tenant_labels = max_tenant_labels
        self._tenant_labels: set[str] = set()
        # request_ids whose prompt tokens are counted (first tokens seen), for tenant metrics.
        self._tenant_prefilled: set[str] = set()
        self.set_idle()

    def set_idle(self) -> None:
        """Zeroes the load gauges; only valid when the engine holds no request at all."""
        self.vllm.set_idle()

    def observe_admission(self, specs: Sequence[RequestSpec]) -> None:
        """Requests the engine accepted (engine thread), for vLLM's per-parent histograms."""
        self.vllm.add_requests(specs)

    def observe_step(self, stats: SchedulerStats, step_seconds: float) -> None:
        self.vllm.observe_step(stats)
        self.engine_steps.inc()
        if stats.num_scheduled_tokens:
            self.step_duration.observe(step_seconds)
            self.batch_size.observe(stats.num_scheduled_reqs)
            self.scheduled_tokens.observe(stats.num_scheduled_tokens)

    def observe_output(self, out: RequestOutput, now: float | None = None) -> None:
        """Feeds one request's delta; `now` is when the step that produced it finished."""
        self.vllm.observe_output(out, time.monotonic() if now is None else now)

    def reserve_tenant_labels(self, tenant_ids: list[str]) -> None:
        """Gives the key file's tenants their labels first (up to the cap), so tenants a gateway
        names cannot take them, and labels do not depend on who came first after a restart."""
        for tenant_id in tenant_ids:
            self.tenant_label(tenant_id)

    def tenant_label(self, tenant_id: str) -> str:
        """The tenant's own label while fewer than max_tenant_labels are in use, else "other"."""
        if tenant_id in self._tenant_labels:
            return tenant_id
        if len(self._tenant_labels) < self.max_tenant_labels:
            self._tenant_labels.add(tenant_id)
            return tenant_id
        return OTHER_TENANTS_LABEL

    def _tenant_inc(self, name: str, tenant_id: str, amount: float = 1) -> None:
        self.tenant_counters[name].labels(model_name=self._model_name,
                                          tenant=self.tenant_label(tenant_id)).inc(amount)

    def observe_tenant_output(self, tenant_id: str, out: RequestOutput) -> None:
        """The tenant side of `observe_output` (called on the event loop, which knows tenants)."""
        if out.new_token_ids:
            if out.request_id not in self._tenant_prefilled:
                self._tenant_prefilled.add(out.request_id)
                self._tenant_inc("prompt_tokens", tenant_id, out.num_prompt_tokens)
            self._tenant_inc("generation_tokens", tenant_id, len(out.new_token_ids))
        if out.finish_reason is None:
            return
        self._tenant_prefilled.discard(out.request_id)
        self._tenant_inc("requests", tenant_id)
        if out.timings is not None:
            self.tenant_queue_time.labels(model_name=self._model_name,
                                          tenant=self.tenant_label(tenant_id)
                                          ).observe(out.timings.queue_seconds)

    def forget_tenant_request(self, request_id: str) -> None:
        self._tenant_prefilled.discard(request_id)

    def observe_tenant_refused(self, tenant_id: str) -> None:
        self._tenant_inc("requests_refused", tenant_id)

    def render(self) -> bytes:
        return generate_latest(self.registry)
