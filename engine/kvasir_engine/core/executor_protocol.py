"""`Executor`: the one seam between the torch-free core and the device side.

`EngineCore` holds an Executor and never imports torch (docs/architecture.md, rule 5); the in-process and the
tensor-parallel executors implement it in `worker/`, and tests implement it with a fake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvasir_engine.config import RuntimeInfo
from kvasir_engine.core.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def initialize(self) -> RuntimeInfo:
        """Load the model, size and allocate the KV cache; called once, before any step.

        `RuntimeInfo.num_kv_blocks` counts every block of the KV tensors, block 0 included:
        the core reserves block 0 as the null block (never handed to a request), so the runner
        may pad block tables and slot mappings with 0.
        """
        ...

    def execute_model(self, scheduler_output: SchedulerOutput,
                      between_layers: Callable[[], None] | None = None) -> ModelRunnerOutput:
        """Run one forward pass over the plan and sample.

        Never called with an empty plan (`total_num_scheduled_tokens == 0`). Apply
        `finished_req_ids` (forget those requests) before adding `scheduled_new_reqs`: a
        preempted request can come back as new in the plan that also names it finished.
        `between_layers`: an executor that runs the model in this thread may call it between
        two decoder layers, while this pass waits; the call may run `execute_model` for another
        plan (the core's interjection, `EngineCore.interject`). Others never call it.

        Raises `RequestError` when some requests' own data made the step fail; the core then
        finishes those with an error and re-plans the rest from scratch (so the executor need
        not undo what it had done for the failed plan).
        """
        ...

    def shutdown(self) -> None:
        ...
