"""vLLM's Prometheus metrics: its names, types, labels and buckets, fed from Kvasir's engine.

Each family is one that vLLM's `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) exports by
default, labelled `model_name` and `engine` (a Kvasir server runs one engine: "0"), so vLLM's
Grafana dashboards, alerts and KEDA recipes read a Kvasir server unchanged. docs/metrics.md is
the table of them with what Kvasir measures for each; test_metrics_parity.py holds /metrics to it.
Every series exists from the start (at zero), as vLLM creates them.

Fed on the engine thread: `observe_step` from each step's `SchedulerStats`; `observe_output` from
each `RequestOutput` (its first tokens, then its finish with the scheduler's timestamps);
`add_requests` at admission, where a prompt's n choices become one parent, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvasir_engine.core.outputs import SchedulerStats
from kvasir_engine.frontend.engine_types import RequestSpec
from kvasir_engine.frontend.request_output import RequestOutput

M = TypeVar("M", Gauge, Counter)

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # vLLM labels by data-parallel engine; a Kvasir server has one

# vLLM's buckets, so histograms from both engines can be compared on one dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

# Every finish reason a request can have (RequestStatus.finish_reason). vLLM has "repetition"
# too, for its repetition detection, which Kvasir does not have.
FINISHED_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's cache tiers are device, host, p2p, disk and external_unspecified; Kvasir's prefix
# cache lives in the engine's own KV memory only.
CACHED_SOURCES = ("device",)
# "deferred": held back by a transient constraint (LoRA budget, a pending KV transfer), which
# Kvasir has none of, so every waiting request waits for capacity.
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # Kvasir never sleeps: awake = 1
SPEC_DECODE_COUNTERS = {
    "num_drafts": "Number of spec decoding drafts.",
    "num_draft_tokens": "Number of draft tokens.",
    "num_accepted_tokens": "Number of accepted tokens.",
}


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


@dataclass
class _Parent:
    """A prompt's n choices (vLLM's ParentRequest): observed once all of them finished."""

    n: int
    num_unfinished: int
    max_num_generation_tokens: int = 0


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int, *,
                 cache_info: Mapping[str, str], num_speculative_tokens: int = 0) -> None:
        values = (model_name, ENGINE_INDEX)
        self._values = values
        token_buckets = buckets_1_2_5(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*values)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*values)

        def by(metric: type[M], name: str, doc: str, label: str,
               label_values: Sequence[str]) -> dict[str, M]:
            family = metric(name, doc, [*LABELS, label], registry=registry)
            return {v: family.labels(*values, v) for v in label_values}

        # Scheduler state, after each step.
        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.num_requests_waiting_by_reason = by(
            Gauge, "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            "reason", WAITING_REASONS)
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc",
                                         "KV-cache usage. 1 means 100 percent usage.")
        sleep_state = by(Gauge, "vllm:engine_sleep_state",
                         "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
                         "engine is awake; weights_offloaded = 1 means sleep level 1; "
                         "discard_all = 1 means sleep level 2.", "sleep_state", SLEEP_STATES)
        sleep_state["awake"].set(1)
        # An info metric emulated by a gauge at 1, as vLLM does; its labels are the config.
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              [*cache_info, "engine"], registry=registry).labels(
                  *cache_info.values(), ENGINE_INDEX).set(1)

        # Counters.
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = by(Counter, "vllm:prompt_tokens_by_source",
                                          "Number of prompt tokens by source.", "source",
                                          PROMPT_SOURCES)
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        self.prompt_tokens_cached_by_source = by(
            Counter, "vllm:prompt_tokens_cached_by_source",
            "Number of cached prompt tokens by the cache tier that held them.", "source",
            CACHED_SOURCES)
        self.prompt_tokens_recomputed = counter(
            "vllm:prompt_tokens_recomputed",
            "Number of cached tokens recomputed for forward pass.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.request_success = by(Counter, "vllm:request_success",
                                  "Count of successfully processed requests.", "finished_reason",
                                  FINISHED_REASONS)

        # Histograms of counts.
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.request_params_n = histogram("vllm:request_params_n",
                                          "Histogram of the n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets)

        # Histograms of timing intervals.
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.",
                                             TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.",
                                             ITL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)

        # Speculative decoding (docs/speculative.md): only with --speculative-config, as vLLM.
        self.spec_decode: dict[str, Counter] = {}
        self.spec_decode_num_accepted_tokens_per_pos: dict[str, Counter] = {}
        if num_speculative_tokens:
            self.spec_decode = {name: counter(f"vllm:spec_decode_{name}", doc)
                                for name, doc in SPEC_DECODE_COUNTERS.items()}
            self.spec_decode_num_accepted_tokens_per_pos = by(
                Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.", "position",
                [str(p) for p in range(num_speculative_tokens)])

        # request_id -> engine-thread time its latest token arrived (inter-token latency).
        self._last_token_time: dict[str, float] = {}
        # request_id -> its parent (a prompt's n choices), from admission to finish.
        self._parent_of: dict[str, _Parent] = {}

    def set_idle(self) -> None:
        """Zeroes the load gauges; only valid when the engine holds no request at all."""
        self.num_requests_running.set(0)
        self.num_requests_waiting.set(0)
        self.num_requests_waiting_by_reason["capacity"].set(0)
        self.kv_cache_usage_perc.set(0.0)

    def add_requests(self, specs: Sequence[RequestSpec]) -> None:
        """Admitted requests; those naming one `parent_id` are one prompt's n choices."""
        children: dict[str, list[str]] = {}
        for spec in specs:
            children.setdefault(spec.parent_id or spec.request_id, []).append(spec.request_id)
        for request_ids in children.values():
            parent = _Parent(n=len(request_ids), num_unfinished=len(request_ids))
            for request_id in request_ids:
                self._parent_of[request_id] = parent

    def observe_step(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.num_requests_waiting_by_reason["capacity"].set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_scheduled_tokens:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        if self.spec_decode and stats.num_spec_drafts:
            self.spec_decode["num_drafts"].inc(stats.num_spec_drafts)
            self.spec_decode["num_draft_tokens"].inc(stats.num_spec_draft_tokens)
            self.spec_decode["num_accepted_tokens"].inc(stats.num_spec_accepted_tokens)
            for position, num in enumerate(stats.num_spec_accepted_tokens_per_pos):
                self.spec_decode_num_accepted_tokens_per_pos[str(position)].inc(num)

    def observe_output(self, out: RequestOutput, now: float) -> None:
        """One request's delta; `now` is when the step that produced it finished."""
        num_new = len(out.new_token_ids)
        if out.ttft_seconds is not None:  # its first tokens: the prefill is done
            self.time_to_first_token.observe(out.ttft_seconds)
            self._observe_prompt(out)
        if num_new:
            last = self._last_token_time.get(out.request_id)
            if last is not None:
                # Per token: a step that yields k tokens (speculation) is k intervals of 1/k.
                interval = (now - last) / num_new
                for _ in range(num_new):
                    self.inter_token_latency.observe(interval)
            self._last_token_time[out.request_id] = now
            self.generation_tokens.inc(num_new)
        if out.finish_reason is not None:
            self._last_token_time.pop(out.request_id, None)
            self._observe_finished(out, out.finish_reason)

    def _observe_prompt(self, out: RequestOutput) -> None:
        """vLLM's prompt-token accounting (PromptTokenStats), once a prompt is prefilled. A hit
        never covers the whole prompt (its last token is always computed); vLLM counts that
        token as "recomputed" when all the others were cached."""
        num_cached = out.num_cached_tokens
        num_recomputed = int(num_cached + 1 == out.num_prompt_tokens)
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.prompt_tokens_by_source["local_compute"].inc(out.num_prompt_tokens - num_cached)
        self.prompt_tokens_by_source["local_cache_hit"].inc(num_cached + num_recomputed)
        self.prompt_tokens_cached.inc(num_cached)
        self.prompt_tokens_cached_by_source["device"].inc(num_cached)
        self.prompt_tokens_recomputed.inc(num_recomputed)

    def _observe_finished(self, out: RequestOutput, finish_reason: str) -> None:
        """vLLM observes every finished request, whatever its reason, in the success counter
        and the e2e and token histograms; a phase only if the request reached it."""
        self.request_success[finish_reason].inc()
        self.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.request_generation_tokens.observe(out.num_output_tokens)
        stats = out.finished
        if stats is not None:
            self.e2e_request_latency.observe(stats.e2e_seconds)
            self.request_params_max_tokens.observe(stats.max_tokens)
            if stats.queue_seconds is not None:
                self.request_queue_time.observe(stats.queue_seconds)
            if stats.prefill_seconds is not None and stats.decode_seconds is not None:
                self.request_prefill_time.observe(stats.prefill_seconds)
                self.request_decode_time.observe(stats.decode_seconds)
                self.request_inference_time.observe(stats.prefill_seconds + stats.decode_seconds)
                self.request_prefill_kv_computed_tokens.observe(
                    out.num_prompt_tokens - out.num_cached_tokens)
                # The first token is the prefill's; one token alone records 0, as vLLM's.
                num_decoded = out.num_output_tokens - 1
                self.request_time_per_output_token.observe(
                    stats.decode_seconds / num_decoded if num_decoded > 0 else 0.0)
        parent = self._parent_of.pop(out.request_id, None)
        if parent is not None:
            parent.num_unfinished -= 1
            parent.max_num_generation_tokens = max(parent.max_num_generation_tokens,
                                                   out.num_output_tokens)
            if parent.num_unfinished == 0:
                self.request_params_n.observe(parent.n)
                self.request_max_num_generation_tokens.observe(parent.max_num_generation_tokens)
