"""`PipelineModelRunner`: a `ModelRunner` for one stage of a pipeline-parallel model.

Each step, every stage gets the same plain plan (the driver broadcasts it, worker/rank.py) and
keeps the same per-request state. A stage runs its layers (models/llama.py:forward_stage) and
hands the hidden states and the residual, [T, hidden] each, to the same tensor-parallel rank
of the next stage with torch.distributed point-to-point calls: 2 x hidden x dtype bytes per
token per stage boundary, the only traffic between stages. The last stage samples; its
tensor-parallel rank 0 broadcasts the `ModelRunnerOutput` (plain data) to every rank, so the
earlier stages append the same sampled tokens to their own state and the driver answers the
engine.

Micro-batches (--pipeline-micro-batches): a step's requests are cut into contiguous groups.
Stage 0 sends micro-batch 1 (without waiting for it to be received) and starts on micro-batch 2
while stage 1 runs micro-batch 1, so with two stages and two micro-batches a step costs about
1.5 stage-times instead of 2, when a stage's time is proportional to its batch (on CPU it is
not: docs/parallelism.md). The stages still idle between steps (the next plan needs this step's
tokens); `PipelineStats` measures that bubble on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvasir_engine.config import EngineConfig
from kvasir_engine.core.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvasir_engine.core.request import LogprobsEntry
from kvasir_engine.distributed import comm
from kvasir_engine.distributed.parallel_state import RankGroups
from kvasir_engine.models.pipeline_stage import stage_for
from kvasir_engine.worker.input_batch import PreparedBatch
from kvasir_engine.worker.model_runner import ModelRunner, RunnerKVTransfer


@dataclass
class PipelineStats:
    """One rank's account of its steps (seconds, bytes); plain data, gathered at shutdown."""

    rank: int
    pp_rank: int
    num_steps: int = 0
    step_s: float = 0.0  # inside execute_model
    wait_s: float = 0.0  # of which waiting on another stage (receive, send, the answer)
    sent_bytes: int = 0  # hidden states + residuals handed to the next stage
    num_sent_tokens: int = 0

    @property
    def bubble(self) -> float:
        """Fraction of the step time this stage waited for others."""
        return self.wait_s / self.step_s if self.step_s else 0.0


def split_plan(so: SchedulerOutput, num_micro_batches: int) -> list[SchedulerOutput]:
    """The plan as up to `num_micro_batches` plans over contiguous groups of its requests, in
    batch order (new, then cached); their state updates partition the whole plan's."""
    entries: list[NewRequestData | CachedRequestData] = [*so.scheduled_new_reqs,
                                                         *so.scheduled_cached_reqs]
    count = max(1, min(num_micro_batches, len(entries)))
    if count == 1:
        return [so]
    plans = []
    for k in range(count):
        part = entries[k * len(entries) // count:(k + 1) * len(entries) // count]
        tokens = {r.request_id: so.num_scheduled_tokens[r.request_id] for r in part}
        plans.append(SchedulerOutput(
            [r for r in part if isinstance(r, NewRequestData)],
            [r for r in part if isinstance(r, CachedRequestData)],
            tokens, sum(tokens.values()), so.finished_req_ids if k == 0 else set()))
    return plans


def merge_outputs(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    if len(outputs) == 1:
        return outputs[0]
    prompt: list[list[LogprobsEntry] | None] = []
    for out in outputs:
        prompt += out.prompt_logprobs or [None] * len(out.req_ids)
    return ModelRunnerOutput(
        [r for out in outputs for r in out.req_ids],
        [t for out in outputs for t in out.sampled_token_ids],
        [lp for out in outputs for lp in out.logprobs],
        prompt if any(p is not None for p in prompt) else [])


class PipelineModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, groups: RankGroups, local_rank: int,
                 kv_connector: RunnerKVTransfer | None = None):
        stage = stage_for(config.model.arch, groups.pp_rank, groups.pp_size)
        super().__init__(config, groups.tp.tp_rank,
                         groups.tp if groups.tp.tp_size > 1 else None, stage, local_rank,
                         kv_connector)
        self.groups = groups
        self.num_micro_batches = config.parallel.num_micro_batches
        self.stats = PipelineStats(groups.rank, groups.pp_rank)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """A rank process's step: micro-batches through the stages."""
        if self.stage.pp_size == 1:
            return super().execute_model(so)
        started = time.perf_counter()
        outputs: list[ModelRunnerOutput] = []
        sends = []
        for plan in split_plan(so, self.num_micro_batches):
            if self.stage.is_last:  # receives in forward(), samples as one stage would
                outputs.append(super().execute_model(plan))
                continue
            self.update_states(plan)
            if plan.is_empty:
                continue
            batch = self.prepare(plan)
            hidden, residual = self._stage_forward(batch)
            if residual is None:
                raise RuntimeError("a stage before the last produced no residual")
            handoff = torch.stack([hidden, residual])  # [2, T, hidden]
            sends.append((comm.send(handoff, self.groups.stage_rank(self.stage.pp_rank + 1)),
                          handoff))  # the tensor lives until its send is done
            self.stats.sent_bytes += handoff.numel() * handoff.element_size()
            self.stats.num_sent_tokens += plan.total_num_scheduled_tokens
        waited = time.perf_counter()
        for work, _ in sends:
            if work is not None:
                work.wait()
        output = merge_outputs(outputs) if outputs else None
        output = comm.broadcast_object(output, self.groups.last_stage_leader,
                                       self.groups.control)
        self.stats.wait_s += time.perf_counter() - waited
        if not self.stage.is_last:
            self._apply(so, output)
        self.stats.num_steps += 1
        self.stats.step_s += time.perf_counter() - started
        return output  # type: ignore[no-any-return]

    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """The last stage's forward: the previous stage's hand-off in, the normed hidden
        [T, hidden] out."""
        hidden, _ = self._stage_forward(batch)
        return hidden

    def _start_forward(self, batch: PreparedBatch) -> torch.Tensor:
        """Whole, never a layer at a time: a stage waits on its neighbours, nothing cuts in."""
        return self.forward(batch)

    def _stage_forward(self, batch: PreparedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = residual = None
        if not self.stage.is_first:
            handoff = torch.empty(2, batch.input_ids.shape[0], self.arch.hidden_size,
                                  dtype=self.dtype, device=self.device)
            started = time.perf_counter()
            comm.recv(handoff, self.groups.stage_rank(self.stage.pp_rank - 1))
            self.stats.wait_s += time.perf_counter() - started
            hidden, residual = handoff[0], handoff[1]
        return self.model.forward_stage(batch.input_ids, batch.positions, self.kv_caches,
                                        batch.meta, hidden, residual)

    def _apply(self, so: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """What the last stage did to its state, done to this stage's: tokens computed,
        tokens sampled."""
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            self.states[req_id].num_computed_tokens += num_tokens
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True):
            self.states[req_id].token_ids.extend(tokens)
