"""Prometheus metrics under vLLM's names (label `model_name`), plus `kvasir:` ones of our own.

Existing vLLM dashboards, KEDA recipes and the Gateway API Inference Extension read these names
unchanged. Step-level series are fed from each step's `SchedulerStats`; request-level series from
the `RequestOutput`s a step returns (timings on the final one). The registry is private to the
instance, so two servers in one process (tests) never share counters.

`kvasir:tenant_*` series carry a `tenant` label whose distinct values are capped
(`max_tenant_labels`): tenants beyond the cap, in order of first appearance, are counted under
`tenant="other"`, so a flood of gateway-named tenants cannot blow up Prometheus' memory.
"""

from __future__ import annotations

import time
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvasir_engine.core.outputs import SchedulerStats
from kvasir_engine.frontend.request_output import RequestOutput

M = TypeVar("M", Gauge, Counter, Histogram)

OTHER_TENANTS_LABEL = "other"
TENANT_COUNTERS = {
    "requests": "Finished requests (sequences) of a tenant",
    "prompt_tokens": "Prefilled prompt tokens of a tenant",
    "generation_tokens": "Generated tokens of a tenant",
    "requests_refused": "HTTP requests of a tenant refused with 429 (a queue bound)",
}
SPEC_DECODE_COUNTERS = {
    "num_drafts": "Draft verifications (a request verifying drafts in a step)",
    "num_draft_tokens": "Draft tokens verified",
    "num_accepted_tokens": "Draft tokens accepted",
}

# vLLM's buckets, so histograms from both engines can be compared on one dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def buckets_1_2_5(largest: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > largest:
                return tuple(out)
            out.append(float(value))
        exponent += 1


# Every finish reason a request can have (RequestStatus.finish_reason).
FINISHED_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    def __init__(self, model_name: str, max_model_len: int, max_num_seqs: int,
                 max_tenant_labels: int = 100) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]
        self._model_name = model_name
        self.num_requests_running = Gauge("vllm:num_requests_running",
                                          "Requests in the running batch", label, registry=r)
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting",
                                          "Requests waiting to be scheduled", label, registry=r)
        self.kv_cache_usage_perc = Gauge("vllm:kv_cache_usage_perc",
                                         "Fraction of KV-cache blocks in use, 0..1", label,
                                         registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens", label,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", label,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests",
                                       ["model_name", "finished_reason"], registry=r)
        for reason in FINISHED_REASONS:  # every series exists from the start, as vLLM's do
            self.request_success.labels(model_name=model_name, finished_reason=reason)
        self.num_preemptions = Counter("vllm:num_preemptions", "Preemptions", label, registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", label,
                                            registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache", label,
                                         registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", label,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens",
                             label, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", label,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time waiting to start",
                                    label, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens per request", label,
                                               buckets=token_buckets, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request", label,
                                                   buckets=token_buckets, registry=r)
        self.step_duration = Histogram("kvasir:step_duration_seconds",
                                       "Wall time of one engine step", label,
                                       buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("kvasir:batch_size", "Requests scheduled in one step", label,
                                    buckets=buckets_1_2_5(max(max_num_seqs, 1)), registry=r)
        self.scheduled_tokens = Histogram("kvasir:scheduled_tokens_per_step",
                                          "Tokens computed in one step", label,
                                          buckets=buckets_1_2_5(max(max_model_len, 1)), registry=r)
        self.engine_steps = Counter("kvasir:engine_steps", "Engine steps run", label, registry=r)
        # vllm:spec_decode_<name>_total (speculative decoding, docs/speculative.md).
        self.spec_decode_counters = {name: Counter(f"vllm:spec_decode_{name}", doc, label,
                                                   registry=r)
                                     for name, doc in SPEC_DECODE_COUNTERS.items()}
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first)",
            ["model_name", "position"], registry=r)
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
        # request_id -> monotonic time its latest token arrived (for inter-token latency).
        self._last_token_time: dict[str, float] = {}
        self.set_idle()

    def _l(self, metric: M) -> M:
        return metric.labels(model_name=self._model_name)

    def set_idle(self) -> None:
        """Zeroes the load gauges; only valid when the engine holds no request at all."""
        self._l(self.num_requests_running).set(0)
        self._l(self.num_requests_waiting).set(0)
        self._l(self.kv_cache_usage_perc).set(0.0)

    def observe_step(self, stats: SchedulerStats, step_seconds: float) -> None:
        self._l(self.num_requests_running).set(stats.num_running_reqs)
        self._l(self.num_requests_waiting).set(stats.num_waiting_reqs)
        self._l(self.kv_cache_usage_perc).set(stats.kv_cache_usage)
        self._l(self.num_preemptions).inc(stats.num_preemptions)
        self._l(self.prefix_cache_queries).inc(stats.prefix_cache_queries)
        self._l(self.prefix_cache_hits).inc(stats.prefix_cache_hits)
        self._l(self.engine_steps).inc()
        if stats.num_spec_drafts:
            for name, num in (("num_drafts", stats.num_spec_drafts),
                              ("num_draft_tokens", stats.num_spec_draft_tokens),
                              ("num_accepted_tokens", stats.num_spec_accepted_tokens)):
                self._l(self.spec_decode_counters[name]).inc(num)
            for position, num in enumerate(stats.num_spec_accepted_tokens_per_pos):
                self.spec_decode_num_accepted_tokens_per_pos.labels(
                    model_name=self._model_name, position=str(position)).inc(num)
        if stats.num_scheduled_tokens:
            self._l(self.step_duration).observe(step_seconds)
            self._l(self.batch_size).observe(stats.num_scheduled_reqs)
            self._l(self.scheduled_tokens).observe(stats.num_scheduled_tokens)

    def observe_output(self, out: RequestOutput, now: float | None = None) -> None:
        """Feeds one request's delta; `now` is when the step that produced it finished."""
        now = time.monotonic() if now is None else now
        num_new = len(out.new_token_ids)
        if num_new:
            last = self._last_token_time.get(out.request_id)
            if last is None:
                self._l(self.prompt_tokens).inc(out.num_prompt_tokens)
            else:
                interval = (now - last) / num_new
                for _ in range(num_new):
                    self._l(self.itl).observe(interval)
            self._last_token_time[out.request_id] = now
            self._l(self.generation_tokens).inc(num_new)
        if out.finish_reason is None:
            return
        self._last_token_time.pop(out.request_id, None)
        self.request_success.labels(model_name=self._model_name,
                                    finished_reason=out.finish_reason).inc()
        self._l(self.request_prompt_tokens).observe(out.num_prompt_tokens)
        self._l(self.request_generation_tokens).observe(out.num_output_tokens)
        if out.timings is not None:
            t = out.timings
            if out.num_output_tokens:
                self._l(self.ttft).observe(t.queue_seconds + t.prefill_seconds)
            self._l(self.queue_time).observe(t.queue_seconds)
            self._l(self.e2e).observe(t.e2e_seconds)

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
