"""`LLMEngine` over a scripted executor: a stop string finishes its request in the core as a
normal stop (FINISHED_STOPPED, blocks freed in the same step), never through the abort path;
the core alone gives requests the model's EOS ids."""

from __future__ import annotations

from kvasir_engine.checkpoint.arch import ModelArch
from kvasir_engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RuntimeInfo,
    SchedulerConfig,
)
from kvasir_engine.core.engine_core import EngineCore
from kvasir_engine.core.executor_protocol import WholeForward
from kvasir_engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvasir_engine.core.request import RequestStatus, SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from kvasir_engine.tokenizer import Tokenizer

BLOCK_SIZE = 4
EOS_IDS = frozenset({2})


class ScriptedExecutor:
    """Samples the next token of `script` for every request that completes its prompt."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.num_sampled: dict[str, int] = {}

    def initialize(self) -> RuntimeInfo:
        return RuntimeInfo(num_kv_blocks=64, block_size=BLOCK_SIZE, eos_token_ids=EOS_IDS,
                           device="cpu", kv_cache_bytes=64 * BLOCK_SIZE)

    def start_model(self, scheduler_output: SchedulerOutput) -> WholeForward:
        return WholeForward(lambda: self.execute_model(scheduler_output))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            index = self.num_sampled.get(req_id, 0)
            self.num_sampled[req_id] = index + 1
            sampled.append([self.script[index]])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=[])

    def shutdown(self) -> None:
        pass


def _engine(tokenizer: Tokenizer, text: str) -> tuple[LLMEngine, list[tuple[str, ...]]]:
    arch = ModelArch(architecture="LlamaForCausalLM", vocab_size=384, hidden_size=8,
                     intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, max_position_embeddings=256)
    config = EngineConfig(
        model=ModelConfig(model="fake", arch=arch, served_model_name="fake", dtype="float32",
                          max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_model_len=128))
    core = EngineCore(config, ScriptedExecutor(tokenizer.encode(text, add_special_tokens=False)))
    calls: list[tuple[str, ...]] = []
    finish = core.scheduler.finish_requests

    def spy(req_ids: list[str], status: RequestStatus) -> None:
        calls.append((status.name, *req_ids))
        finish(req_ids, status)

    core.scheduler.finish_requests = spy  # type: ignore[method-assign]
    return LLMEngine(config, core, tokenizer), calls


def test_a_stop_string_finishes_as_stopped_not_aborted(tokenizer: Tokenizer) -> None:
    engine, calls = _engine(tokenizer, "Hello world! The quick brown fox")
    engine.add_request("r", tokenizer.encode("Say:"), SamplingParams(max_tokens=30,
                                                                     stop=("world",)))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert calls == [("FINISHED_STOPPED", "r")]
    assert "".join(o.text_delta for o in outputs) == "Hello "
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", "world")
    kv = engine.core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_abort_is_an_abort_and_eos_ids_come_from_the_core(tokenizer: Tokenizer) -> None:
    engine, calls = _engine(tokenizer, "Hello world")
    engine.add_request("r", tokenizer.encode("Say:"), SamplingParams(max_tokens=30))
    assert engine.core.scheduler.requests["r"].eos_token_ids == EOS_IDS
    engine.step()
    engine.abort_request(["r"])
    assert calls == [("FINISHED_ABORTED", "r")]
    assert not engine.has_unfinished_requests()
