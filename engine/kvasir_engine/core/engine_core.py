"""`EngineCore`: the engine's one visible loop.

`step()` is three calls: the scheduler plans, the executor runs the plan on the device, the
scheduler takes the sampled tokens back and decides who finished (docs/architecture.md, rule 5). The executor is
injected, so the core stays torch-free and tests drive it with a fake. Single-threaded: callers
(the front end's `LLMEngine`, driven offline or by the server's engine thread) call
`add_request`, `abort_requests`, `finish_requests` and `step` from one thread.

The server's engine thread runs the same step in the open instead (`begin_step`, the forward
pass a decoder layer at a time, `end_step`), so that between two layers it can admit what
arrived and `interject` a newcomer's first token: the caller drives every part, and nothing
calls back up from the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvasir_engine.config import EngineConfig, RuntimeInfo
from kvasir_engine.core.executor_protocol import Executor, ForwardInFlight, WholeForward
from kvasir_engine.core.limits import FitError
from kvasir_engine.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    RequestError,
    SchedulerOutput,
)
from kvasir_engine.core.request import Request, RequestStatus
from kvasir_engine.core.scheduler import Scheduler
from kvasir_engine.kv.block_pool import KVCacheEvent

logger = logging.getLogger(__name__)

_EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])


@dataclass
class StepInFlight:
    """A step between `EngineCore.begin_step` and `end_step`."""

    scheduler_output: SchedulerOutput
    start_time: float  # perf_counter at begin_step
    forward: ForwardInFlight | None  # None when the plan failed to start (`failed_outputs`)
    failed_outputs: list[EngineCoreOutput] = field(default_factory=list)

    def advance(self) -> bool:
        """Run the next part of its forward pass; False once none is left."""
        return self.forward is not None and self.forward.advance()


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.runtime: RuntimeInfo = executor.initialize()
        if self.runtime.block_size != config.cache.block_size:
            raise ValueError(f"the executor's block size ({self.runtime.block_size}) differs "
                             f"from --block-size ({config.cache.block_size})")
        self.scheduler = Scheduler(config.scheduler, num_kv_blocks=self.runtime.num_kv_blocks,
                                   block_size=self.runtime.block_size,
                                   enable_caching=config.cache.enable_prefix_caching,
                                   speculative=config.speculative)
        self.step_index = 0

    def add_request(self, request: Request) -> None:
        """Queue a request (ValueError if it can never fit, QueueFullError if the queue is full).

        A request without EOS ids gets the model's, so callers need not know them.
        """
        if not request.eos_token_ids:
            request.eos_token_ids = self.runtime.eos_token_ids
        self.scheduler.add_request(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests now with `status`; their blocks are freed at once. The front end
        finishes a request whose stop string it found with FINISHED_STOPPED: a normal finish,
        not an abort.

        Unknown or already finished ids are ignored.
        """
        self.scheduler.finish_requests(req_ids, status)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """The caller gave up on these requests (client gone): FINISHED_ABORTED."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def abort_request(self, req_id: str) -> None:
        self.abort_requests([req_id])

    def fit_error(self, num_prompt_tokens: int, max_tokens: int) -> FitError | None:
        """Why such a request could never be scheduled, or None (`Scheduler.fit_error`)."""
        return self.scheduler.fit_error(num_prompt_tokens, max_tokens)

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens one request can hold: every block but the reserved null block 0."""
        return self.scheduler.kv_cache_manager.max_num_tokens

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def release_kv_holds(self, req_ids: Iterable[str]) -> None:
        """Free the blocks a producer kept for these finished requests' consumers (`KVHold`)."""
        for req_id in req_ids:
            self.scheduler.kv_cache_manager.release_held(req_id)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (`BlockPool.take_events`)."""
        return self.scheduler.kv_cache_manager.take_events()

    def step(self) -> EngineCoreOutputs:
        """One step: the scheduler plans, the executor runs the plan, the scheduler takes the
        sampled tokens back (`begin_step`, then `end_step`, which runs the whole forward pass
        when nobody advanced it in parts)."""
        return self.end_step(self.begin_step())

    def begin_step(self) -> StepInFlight:
        """The next step planned and started: its caller runs the forward pass a part (a
        decoder layer) at a time with `StepInFlight.advance`, and between two parts may add
        requests and `interject`; then `end_step`."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return StepInFlight(scheduler_output, start, WholeForward(
                lambda: _EMPTY_MODEL_RUNNER_OUTPUT))
        try:
            return StepInFlight(scheduler_output, start,
                                self.executor.start_model(scheduler_output))
        except RequestError as e:
            return StepInFlight(scheduler_output, start, None, self._fail(scheduler_output, e))

    def end_step(self, step: StepInFlight) -> EngineCoreOutputs:
        """The step's tokens taken back: who finished, the stats."""
        outputs = (step.failed_outputs if step.forward is None
                   else self._finish(step.scheduler_output, step.forward))
        self.step_index += 1
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 step_index=self.step_index,
                                 step_seconds=time.perf_counter() - step.start_time)

    def interject(self) -> list[EngineCoreOutput] | None:
        """Between two parts of a step in flight: run the first token of a request added since
        that step began, if the scheduler lets one cut in (`Scheduler.schedule_interjection`),
        and return its output; None when nobody did. Its tokens and prefix-cache counts are
        part of the step in flight's stats."""
        scheduler_output = self.scheduler.schedule_interjection()
        if scheduler_output is None:
            return None
        return self._finish(scheduler_output,
                            WholeForward(lambda: self.executor.execute_model(scheduler_output)))

    def _finish(self, scheduler_output: SchedulerOutput,
                forward: ForwardInFlight) -> list[EngineCoreOutput]:
        """Run what is left of a plan and take its tokens back. A `RequestError` fails only the
        requests it names (`Scheduler.fail_plan`); any other exception is the engine's and
        propagates."""
        try:
            model_runner_output = forward.finish()
        except RequestError as e:
            return self._fail(scheduler_output, e)
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def _fail(self, scheduler_output: SchedulerOutput,
              error: RequestError) -> list[EngineCoreOutput]:
        logger.error("step %d failed for requests %s, which end with an error; the others are "
                     "recomputed: %s", self.step_index, sorted(error.request_ids), error.reason)
        return self.scheduler.fail_plan(scheduler_output, error.request_ids)

    def shutdown(self) -> None:
        self.executor.shutdown()
