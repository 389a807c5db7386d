"""`UniprocExecutor`: the core's `Executor`, running one model runner in this process.

The multi-process executor (`multiproc_executor.py`: tensor- and pipeline-parallel ranks, on
one node or several) implements the same three calls; `make_executor` picks between them from
the parallel config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvasir_engine.config import EngineConfig, RuntimeInfo
from kvasir_engine.core.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvasir_engine.kv_transfer.connector import KVConnector
    from kvasir_engine.worker.model_runner import ModelRunner, RunnerStep


class UniprocExecutor:
    def __init__(self, config: EngineConfig, kv_connector: KVConnector | None = None):
        self.config = config
        self.kv_connector = kv_connector
        self.runner: ModelRunner | None = None

    def initialize(self) -> RuntimeInfo:
        """Load the model and allocate the KV cache; ValueError if the budget is too small."""
        from kvasir_engine.worker.model_runner import ModelRunner

        self.runner = ModelRunner(self.config, kv_connector=self.kv_connector)
        return self.runner.initialize_kv_cache()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._runner().execute_model(scheduler_output)

    def start_model(self, scheduler_output: SchedulerOutput) -> RunnerStep:
        """A layer at a time (`ModelRunner.start_step`)."""
        return self._runner().start_step(scheduler_output)

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("executor used before initialize()")
        return self.runner

    def shutdown(self) -> None:
        self.runner = None


def make_executor(config: EngineConfig,  # type: ignore[no-untyped-def]
                  on_rank_failure: Callable[[str], None] | None = None,
                  kv_connector: KVConnector | None = None):
    """The executor for this config: in-process for one rank on one node, multi-process beyond.

    `on_rank_failure(message)` is called once, from a watchdog thread, as soon as a rank process
    dies or fails (even between steps); an in-process executor has no ranks and never calls it.
    `kv_connector`: disaggregated prefill's (with tensor parallelism, each rank moves its own
    shard: kv_transfer/tensor_parallel.py).
    """
    if config.parallel.is_multiprocess:
        from kvasir_engine.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, on_rank_failure, kv_connector)
    return UniprocExecutor(config, kv_connector)
