"""`LLMEngine`: tokenizer + `EngineCore` + output processor, driven synchronously.

The offline `generate` command and the HTTP server's async bridge both sit on this class; it
adds no scheduling of its own. Data flows one way: `add_request` -> core (scheduler, KV manager,
runner, sampler) -> `EngineCoreOutput`s -> output processor (detokenize, stop strings) ->
`RequestOutput`s. A stop string found by the output processor finishes the request in the core
at once (FINISHED_STOPPED, a normal finish), so its blocks are freed in the same step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvasir_engine.config import EngineConfig, RuntimeInfo
from kvasir_engine.core.engine_core import EngineCore, StepInFlight
from kvasir_engine.core.limits import FitError
from kvasir_engine.core.outputs import EngineCoreOutput, SchedulerStats
from kvasir_engine.core.request import (
    ANONYMOUS_TENANT,
    KVLoadSpec,
    LogprobsEntry,
    Request,
    RequestStatus,
    SamplingParams,
)
from kvasir_engine.frontend.output_processor import OutputProcessor
from kvasir_engine.frontend.prefix_cache_view import PrefixCacheView
from kvasir_engine.frontend.request_output import RequestOutput
from kvasir_engine.kv_transfer.connector import KVConnector
from kvasir_engine.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class FinalOutput:
    """The whole result of one request, as the offline `generate` reports it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    logprobs: list[LogprobsEntry] | None


class LLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCore, tokenizer: Tokenizer,
                 kv_connector: KVConnector | None = None) -> None:
        self.config = config
        # Disaggregated prefill (kv_transfer/): this engine's end of it, or None.
        self.kv_connector = kv_connector
        self.core = core
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self.last_stats = SchedulerStats()
        self.last_step_seconds = 0.0
        self.prefix_cache_view = PrefixCacheView(config.cache.block_size)

    @classmethod
    def from_config(cls, config: EngineConfig,
                    on_executor_failure: Callable[[str], None] | None = None) -> LLMEngine:
        """`on_executor_failure`: see `make_executor` (a dead tensor-parallel rank)."""
        from kvasir_engine.worker.executor import make_executor

        tokenizer = load_tokenizer(config.model.model)
        kv_connector = KVConnector(config) if config.kv_transfer is not None else None
        if kv_connector is not None:
            kv_connector.check_producers()  # before the model loads: a misfit pair fails fast
        try:
            core = EngineCore(config, make_executor(config, on_executor_failure, kv_connector))
        except BaseException:
            if kv_connector is not None:
                kv_connector.shutdown()
            raise
        return cls(config, core, tokenizer, kv_connector)

    @property
    def runtime(self) -> RuntimeInfo:
        return self.core.runtime

    @property
    def step_index(self) -> int:
        return self.core.step_index

    def fit_error(self, num_prompt_tokens: int, max_tokens: int) -> FitError | None:
        """Why such a request could never be scheduled, or None; safe from any thread."""
        return self.core.fit_error(num_prompt_tokens, max_tokens)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    tenant_id: str = ANONYMOUS_TENANT, do_remote_decode: bool = False,
                    kv_load: KVLoadSpec | None = None) -> None:
        """Queue a request. ValueError if it can never fit; QueueFullError if the queue is full.

        `tenant_id` groups requests for the scheduler's fair share and per-tenant bounds. The
        core gives the request the model's EOS ids. `do_remote_decode`: a producer's request,
        whose blocks stay held for its consumer; `kv_load`: a consumer's, with its prompt's
        K/V received (kv_transfer/).
        """
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            cache_salt=cache_salt,
            tenant_id=tenant_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            do_remote_decode=do_remote_decode,
            kv_load=kv_load,
        )
        self.core.add_request(request)
        self.output_processor.add_request(request)

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Abort the requests (client gone); their final "abort" outputs, for the metrics."""
        self.core.abort_requests(list(request_ids))
        return self.output_processor.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step, whole."""
        return self.end_step(self.begin_step())

    def begin_step(self) -> StepInFlight:
        """The next step, for the caller to run a decoder layer at a time
        (`StepInFlight.advance`); between two layers it may `add_request` and `interject`.
        Then `end_step`."""
        if self.kv_connector is not None:  # blocks the block server is done with
            self.core.release_kv_holds(self.kv_connector.take_released())
        return self.core.begin_step()

    def end_step(self, step: StepInFlight) -> list[RequestOutput]:
        core_outputs = self.core.end_step(step)
        self.last_stats = core_outputs.scheduler_stats
        self.last_step_seconds = core_outputs.step_seconds
        return self._process(core_outputs.outputs)

    def interject(self) -> list[RequestOutput] | None:
        """Only between two layers of a step in flight: a newly added request's first token,
        computed while the step waits (`EngineCore.interject`); None when none was."""
        outputs = self.core.interject()
        return None if outputs is None else self._process(outputs)

    def _process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        transfer_params = self._hold_for_consumers(outputs)
        processed = self.output_processor.process_outputs(outputs)
        if processed.stopped_req_ids:
            self.core.finish_requests(processed.stopped_req_ids, RequestStatus.FINISHED_STOPPED)
        self.prefix_cache_view.apply(self.core.take_kv_events())
        if not transfer_params:
            return processed.request_outputs
        return [dataclasses.replace(out, kv_transfer_params=transfer_params[out.request_id])
                if out.request_id in transfer_params else out
                for out in processed.request_outputs]

    def _hold_for_consumers(self, outputs: list[EngineCoreOutput]) -> dict[str, dict[str, Any]]:
        """A producer's finished requests' held blocks go to the block server; their answers'
        `kv_transfer_params`, by request id."""
        params: dict[str, dict[str, Any]] = {}
        for out in outputs:
            if out.kv_hold is None:
                continue
            if self.kv_connector is None or self.kv_connector.server is None:
                self.core.release_kv_holds([out.request_id])  # nobody could fetch them
                continue
            params[out.request_id] = self.kv_connector.hold(out.request_id, out.kv_hold)
        return params

    def generate(self, prompts: Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[FinalOutput]:
        """Schedule every prompt together and run until all finish (offline use)."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
        ids = [f"gen-{self.core.step_index}-{i}" for i in range(len(prompts))]
        for request_id, prompt, sp in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(request_id, prompt, sp)
        pieces: dict[str, list[RequestOutput]] = {request_id: [] for request_id in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                pieces[out.request_id].append(out)
        return [_final(request_id, prompt, pieces[request_id])
                for request_id, prompt in zip(ids, prompts, strict=True)]

    def shutdown(self) -> None:
        self.core.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()


def _final(request_id: str, prompt: list[int], outputs: list[RequestOutput]) -> FinalOutput:
    token_ids = [t for out in outputs for t in out.new_token_ids]
    logprobs = [lp for out in outputs for lp in (out.new_logprobs or [])]
    last = outputs[-1]
    return FinalOutput(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        token_ids=token_ids,
        text="".join(out.text_delta for out in outputs),
        finish_reason=last.finish_reason or "abort",
        num_cached_tokens=last.num_cached_tokens,
        logprobs=logprobs or None,
    )
