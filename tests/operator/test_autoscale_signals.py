"""Parsing engine /metrics pages into per-pod samples."""

from __future__ import annotations

import pytest
from kvasir_operator.autoscale.signals import PodSample, Signal, parse_metrics

VLLM_PAGE = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 2.0
vllm:num_requests_waiting{engine="0",model_name="other"} 100.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 7.0
vllm:num_requests_running{engine="1",model_name="llama"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.25
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="llama"} 0.9
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="llama"} 12345.0
"""

SGLANG_PAGE = """\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen"} 4
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen"} 9
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen"} 0.42
"""


def parse(text: str, model: str | None = None) -> PodSample:
    return parse_metrics(text, pod_name="p0", timestamp=100.0, model_name=model)


def test_vllm_counts_sum_over_label_sets_of_the_model_and_kv_takes_the_fullest_engine() -> None:
    sample = parse(VLLM_PAGE, "llama")
    assert sample.error is None
    assert sample.num_waiting == 5.0
    assert sample.num_running == 8.0
    # The current name wins over the deprecated one: no double counting during a rename.
    assert sample.kv_cache_usage == 0.5
    assert sample.timestamp == 100.0


def test_without_a_model_filter_every_series_counts() -> None:
    assert parse(VLLM_PAGE).num_waiting == 105.0


def test_sglang_names_are_accepted() -> None:
    sample = parse(SGLANG_PAGE, "qwen")
    assert (sample.num_waiting, sample.num_running, sample.kv_cache_usage) == (4, 9, 0.42)
    assert sample.has([Signal.WAITING, Signal.RUNNING, Signal.KV_CACHE_USAGE])


def test_deprecated_vllm_kv_name_alone_is_used() -> None:
    page = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.3\nvllm:num_requests_waiting 0\n'
    sample = parse(page, "m")
    assert sample.kv_cache_usage == 0.3
    assert sample.num_waiting == 0
    assert sample.num_running is None
    assert not sample.has([Signal.RUNNING])


def test_a_page_without_any_signal_has_no_values_but_no_error() -> None:
    sample = parse("# nothing here\nprocess_cpu_seconds_total 3\n")
    assert sample.error is None and not sample.has_any_value


@pytest.mark.parametrize(
    ("page", "needle"),
    [
        ("vllm:num_requests_waiting{model_name= 3\n", "malformed"),
        ("vllm:num_requests_waiting NaN\n", "vllm:num_requests_waiting"),
        ("vllm:num_requests_running -1\n", "vllm:num_requests_running"),
        ("vllm:kv_cache_usage_perc 57\n", "vllm:kv_cache_usage_perc"),
    ],
)
def test_bad_pages_give_an_error_sample_naming_the_problem(page: str, needle: str) -> None:
    sample = parse(page)
    assert sample.error is not None and needle in sample.error
    assert not sample.has_any_value
    assert not sample.has([])


def test_sample_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_usage"):
        PodSample("p", 1.0, kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="num_waiting"):
        PodSample("p", 1.0, num_waiting=-2)
    with pytest.raises(ValueError, match="pod_name"):
        PodSample("", 1.0)
