"""vLLM's per-request accounting on CPU, no server: what each finished request is observed in.

The output processor turns the scheduler's timestamps into `FinishedRequestStats` (decode ends
at the last token, not at an abort that comes later) and marks the first-token output; the
metrics observe every finish in the counters and e2e / token histograms, a phase only if the
request reached it, and a prompt's n choices once, when the last of them finishes.
"""

from __future__ import annotations

from kvasir_engine.core.outputs import EngineCoreOutput
from kvasir_engine.core.request import Request, SamplingParams
from kvasir_engine.frontend.engine_types import RequestSpec
from kvasir_engine.frontend.metrics import EngineMetrics
from kvasir_engine.frontend.output_processor import OutputProcessor
from kvasir_engine.frontend.request_output import FinishedRequestStats, RequestOutput
from kvasir_engine.tokenizer import Tokenizer

LABELS = {"model_name": "m", "engine": "0"}


def sample(metrics: EngineMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {**LABELS, **labels})
    return 0.0 if value is None else value


def output(request_id: str, *, num_new: int, finish: str | None = None,
           finished: FinishedRequestStats | None = None, ttft: float | None = None,
           num_output: int = 0, num_prompt: int = 8, num_cached: int = 0) -> RequestOutput:
    return RequestOutput(request_id=request_id, text_delta="", new_token_ids=[1] * num_new,
                         new_logprobs=None, finish_reason=finish, stop_reason=None,
                         num_prompt_tokens=num_prompt, num_output_tokens=num_output,
                         num_cached_tokens=num_cached, finished=finished, ttft_seconds=ttft)


def stats(*, queue: float | None = 0.1, prefill: float | None = 0.2,
          decode: float | None = 0.3) -> FinishedRequestStats:
    return FinishedRequestStats(e2e_seconds=1.0, queue_seconds=queue, prefill_seconds=prefill,
                                decode_seconds=decode, max_tokens=16)


def test_every_finish_is_counted_and_a_phase_only_when_reached() -> None:
    metrics = EngineMetrics("m", max_model_len=64, max_num_seqs=4)
    # Aborted while waiting: never scheduled, no token.
    metrics.observe_output(output("w", num_new=0, finish="abort",
                                  finished=stats(queue=None, prefill=None, decode=None)), 1.0)
    # Failed in its prefill: scheduled, no token.
    metrics.observe_output(output("f", num_new=0, finish="error",
                                  finished=stats(prefill=None, decode=None)), 1.0)
    # One token, then length: time per output token 0, as vLLM's.
    metrics.observe_output(output("one", num_new=1, finish="length", finished=stats(decode=0.0),
                                  ttft=0.3, num_output=1, num_cached=4), 1.0)
    for reason in ("abort", "error", "length"):
        assert sample(metrics, "vllm:request_success_total", finished_reason=reason) == 1
    assert sample(metrics, "vllm:request_success_total", finished_reason="stop") == 0
    assert sample(metrics, "vllm:e2e_request_latency_seconds_count") == 3
    assert sample(metrics, "vllm:request_generation_tokens_count") == 3
    assert sample(metrics, "vllm:request_queue_time_seconds_count") == 2
    for name in ("prefill_time_seconds", "decode_time_seconds", "inference_time_seconds",
                 "time_per_output_token_seconds", "prefill_kv_computed_tokens"):
        assert sample(metrics, f"vllm:request_{name}_count") == 1, name
    assert sample(metrics, "vllm:request_time_per_output_token_seconds_sum") == 0
    assert sample(metrics, "vllm:request_inference_time_seconds_sum") == 0.2
    assert sample(metrics, "vllm:request_prefill_kv_computed_tokens_sum") == 4
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 1
    # 8 prompt tokens, 4 of them cached.
    assert sample(metrics, "vllm:prompt_tokens_total") == 8
    assert sample(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 4
    assert sample(metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 4
    assert sample(metrics, "vllm:prompt_tokens_cached_by_source_total", source="device") == 4


def test_a_prompts_n_choices_are_one_parent() -> None:
    metrics = EngineMetrics("m", max_model_len=64, max_num_seqs=4)
    params = SamplingParams(max_tokens=8)
    metrics.observe_admission([RequestSpec("a-0", [1], params, parent_id="a"),
                               RequestSpec("a-1", [1], params, parent_id="a"),
                               RequestSpec("b", [1], params)])
    metrics.observe_output(output("a-0", num_new=0, finish="length", num_output=5), 1.0)
    assert sample(metrics, "vllm:request_params_n_count") == 0  # a-1 still runs
    metrics.observe_output(output("b", num_new=0, finish="stop", num_output=2), 1.0)
    metrics.observe_output(output("a-1", num_new=0, finish="abort", num_output=3), 1.0)
    assert sample(metrics, "vllm:request_params_n_count") == 2
    assert sample(metrics, "vllm:request_params_n_sum") == 3
    assert sample(metrics, "vllm:request_max_num_generation_tokens_sum") == 5 + 2


def test_decode_ends_at_the_last_token_and_the_first_token_is_marked(
        tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=8), arrival_time=10.0)
    processor.add_request(request)
    request.first_scheduled_time, request.first_token_time = 10.5, 11.0
    request.last_token_time = 11.0
    first = processor.process_outputs([EngineCoreOutput("r", [40])]).request_outputs[0]
    assert first.ttft_seconds == 1.0 and first.finished is None
    request.last_token_time = 12.0
    second = processor.process_outputs([EngineCoreOutput("r", [41])]).request_outputs[0]
    assert second.ttft_seconds is None
    request.finished_time = 20.0  # aborted long after its last token
    final = processor.abort_requests(["r"])[0]
    assert final.finished == FinishedRequestStats(e2e_seconds=10.0, queue_seconds=0.5,
                                                  prefill_seconds=0.5, decode_seconds=1.0,
                                                  max_tokens=8)
