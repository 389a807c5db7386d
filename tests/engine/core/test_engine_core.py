"""EngineCore: the three-call step over the scheduler and a fake executor, plus a property
test that random workloads (tiny caches, chunking, shared prefixes, aborts) lose no output."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvasir_engine.checkpoint.arch import ModelArch
from kvasir_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvasir_engine.core.engine_core import EngineCore
from kvasir_engine.core.request import Request, RequestStatus, SamplingParams
from kvasir_engine.kv.kv_cache_manager import kv_memory_waste
from scheduler_fakes import EOS_TOKEN_ID, FakeExecutor, reference_continuation

ARCH = ModelArch(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=8,
                 intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=4, max_position_embeddings=256)


def _engine(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
            max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
            enable_prefix_caching: bool = True) -> tuple[EngineCore, FakeExecutor]:
    config = EngineConfig(
        model=ModelConfig(model="fake", arch=ARCH, served_model_name="fake", dtype="float32",
                          max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens))
    executor = FakeExecutor(num_blocks, block_size)
    return EngineCore(config, executor), executor


def test_step_counts_and_fills_eos() -> None:
    engine, executor = _engine()
    executor.next_token = lambda token_ids: EOS_TOKEN_ID
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.add_request(request)
    assert request.eos_token_ids == frozenset({EOS_TOKEN_ID})
    outputs = engine.step()
    assert outputs.step_index == 1
    assert [(o.new_token_ids, o.finish_reason) for o in outputs.outputs] == [([EOS_TOKEN_ID],
                                                                              "stop")]
    assert request.first_scheduled_time is not None and request.first_token_time is not None
    assert request.finished_time is not None and request.num_cached_tokens == 0
    assert not engine.has_unfinished_requests()
    # An idle step still advances the counter (liveness) but runs nothing on the device.
    assert engine.step().step_index == 2 and len(executor.history) == 1
    engine.shutdown()
    assert executor.is_shut_down


def test_abort_and_stats() -> None:
    engine, executor = _engine(max_num_batched_tokens=10)
    engine.add_request(Request("a", list(range(1, 13)), SamplingParams(max_tokens=8)))
    engine.add_request(Request("b", [5], SamplingParams(max_tokens=8)))
    stats = engine.step().scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert (stats.num_scheduled_tokens, stats.num_scheduled_reqs) == (10, 1)
    assert stats.kv_cache_usage == pytest.approx(3 / 63)
    assert (stats.num_kv_blocks_in_use, stats.num_kv_tokens_stored) == (3, 10)
    assert kv_memory_waste(stats.num_kv_blocks_in_use, stats.num_kv_tokens_stored, 4) == (
        pytest.approx(1 / 6))
    engine.abort_request("a")
    assert engine.scheduler.make_stats().kv_cache_usage == 0.0
    engine.finish_requests(["a", "gone"], RequestStatus.FINISHED_STOPPED)  # ignored: finished
    assert engine.kv_capacity_tokens == 63 * 4
    outputs = engine.step()
    assert executor.history[-1].finished_req_ids == {"a"}
    assert [o.request_id for o in outputs.outputs] == ["b"]


def test_block_size_mismatch_is_refused() -> None:
    config = _engine()[0].config
    with pytest.raises(ValueError, match="block size"):
        EngineCore(config, FakeExecutor(16, 8))


def test_core_and_kv_import_no_torch() -> None:
    code = ("import sys, kvasir_engine.core.engine_core, kvasir_engine.kv.kv_cache_manager;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')"
            " or m.startswith(('kvasir_engine.worker', 'kvasir_engine.layers'))];"
            "print(bad)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


WORKLOAD = st.lists(
    st.tuples(st.integers(0, 3),  # arrival step
              st.integers(0, 2),  # shared prefix id
              st.lists(st.integers(0, 900), min_size=1, max_size=12),  # own suffix
              st.integers(1, 10),  # max_tokens
              st.booleans()),  # aborted after its first output
    min_size=1, max_size=8)


@settings(max_examples=120, deadline=None)
@given(workload=WORKLOAD, num_blocks=st.integers(9, 24), block_size=st.sampled_from([2, 4]),
       max_num_seqs=st.integers(1, 5), budget_extra=st.integers(0, 12),
       caching=st.booleans())
def test_random_workloads_match_reference(
        workload: list[tuple[int, int, list[int], int, bool]], num_blocks: int, block_size: int,
        max_num_seqs: int, budget_extra: int, caching: bool) -> None:
    engine, _ = _engine(num_blocks=num_blocks, block_size=block_size, max_model_len=40,
                        max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_seqs + budget_extra,
                        enable_prefix_caching=caching)
    prefixes = [list(range(100, 109)), list(range(200, 205)), []]
    requests: dict[str, Request] = {}
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for step in range(400):
        for i, (arrival, prefix_id, suffix, max_tokens, _) in enumerate(workload):
            if arrival == step:
                request = Request(f"r{i}", prefixes[prefix_id] + suffix,
                                  SamplingParams(max_tokens=max_tokens))
                if request.num_tokens + max_tokens - 1 > (num_blocks - 1) * block_size:
                    with pytest.raises(ValueError, match="whole KV cache"):
                        engine.add_request(request)
                    continue
                engine.add_request(request)
                requests[request.request_id] = request
        if step > 3 and not engine.has_unfinished_requests():
            break
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if workload[int(output.request_id[1:])][4] and not output.is_finished:
                engine.abort_request(output.request_id)
                aborted.add(output.request_id)
    else:
        raise AssertionError("the engine did not drain")
    for req_id, request in requests.items():
        expected = reference_continuation(request.prompt_token_ids,
                                          request.sampling_params.max_tokens)
        assert request.output_token_ids == tokens[req_id]
        if req_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert tokens[req_id] == expected[:len(tokens[req_id])]
        else:
            assert tokens[req_id] == expected
            assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])
    assert pool.num_free_blocks == pool.num_usable_blocks
