"""`Executor`: the one seam between the torch-free core and the device side.

`EngineCore` holds an Executor and never imports torch (docs/architecture.md, rule 5); the in-process and the
tensor-parallel executors implement it in `worker/`, and tests implement it with a fake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvasir_engine.config import RuntimeInfo
from kvasir_engine.core.outputs import ModelRunnerOutput, SchedulerOutput


class ForwardInFlight(Protocol):
    """One plan's execution, run by its caller in parts (`Executor.start_model`)."""

    def advance(self) -> bool:
        """Run the next part of the forward pass (one decoder layer); False once none is
        left. Between two calls the caller may run `execute_model` for another plan."""
        ...

    def finish(self) -> ModelRunnerOutput:
        """Run whatever is left, sample, and answer (raises as `execute_model` does)."""
        ...


class WholeForward:
    """A plan run whole at `finish`: for executors whose forward pass has no parts the caller
    can see (tensor- and pipeline-parallel ranks in other processes, test fakes)."""

    def __init__(self, execute: Callable[[], ModelRunnerOutput]) -> None:
        self._execute = execute

    def advance(self) -> bool:
        return False

    def finish(self) -> ModelRunnerOutput:
        return self._execute()


class Executor(Protocol):
    def initialize(self) -> RuntimeInfo:
        """Load the model, size and allocate the KV cache; called once, before any step.

        `RuntimeInfo.num_kv_blocks` counts every block of the KV tensors, block 0 included:
        the core reserves block 0 as the null block (never handed to a request), so the runner
        may pad block tables and slot mappings with 0.
        """
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward pass over the plan and sample.

        Never called with an empty plan (`total_num_scheduled_tokens == 0`). Apply
        `finished_req_ids` (forget those requests) before adding `scheduled_new_reqs`: a
        preempted request can come back as new in the plan that also names it finished.

        Raises `RequestError` when some requests' own data made the step fail; the core then
        finishes those with an error and re-plans the rest from scratch (so the executor need
        not undo what it had done for the failed plan).
        """
        ...

    def start_model(self, scheduler_output: SchedulerOutput) -> ForwardInFlight:
        """The same, for the caller to run in parts (`ForwardInFlight`): an executor that runs
        the model in this thread hands back one decoder layer at a time, so that the engine
        thread can interject a first token between two of them (`EngineCore.interject`); others
        return a `WholeForward`. May raise `RequestError` as `execute_model` does."""
        ...

    def shutdown(self) -> None:
        ...
