"""Drives a `Scheduler` with tenants over the fake paged-cache executor and records, per step,
who was admitted and how many tokens each tenant was served (computed plus sampled)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvasir_engine.config import SchedulerConfig
from kvasir_engine.core.outputs import SchedulerOutput
from kvasir_engine.core.request import Request, SamplingParams
from kvasir_engine.core.scheduler import Scheduler
from scheduler_fakes import EOS_TOKEN_ID, FakeExecutor, reference_continuation


@dataclass
class Harness:
    scheduler: Scheduler
    executor: FakeExecutor
    # request_id -> step index at which it was first admitted.
    admitted_at: dict[str, int] = field(default_factory=dict)
    admission_order: list[str] = field(default_factory=list)
    # tenant -> tokens computed for it (prefill chunks, decodes) and tokens sampled for it.
    tenant_to_num_computed: Counter[str] = field(default_factory=Counter)
    tenant_to_num_sampled: Counter[str] = field(default_factory=Counter)
    request_to_tokens: dict[str, list[int]] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    plans: list[dict[str, int]] = field(default_factory=list)
    # Per step: tenant -> prompt tokens computed (chunks of requests with more than one left).
    prompt_tokens_per_step: list[Counter[str]] = field(default_factory=list)
    num_preemptions: int = 0
    num_steps: int = 0

    def add(self, req_id: str, tenant_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens),
                          eos_token_ids=frozenset({EOS_TOKEN_ID}), tenant_id=tenant_id)
        self.scheduler.add_request(request)
        self.prompts[req_id] = list(prompt)
        return request

    def step(self) -> SchedulerOutput:
        scheduler = self.scheduler
        tenant_of = {req_id: r.tenant_id for req_id, r in scheduler.requests.items()}
        plan = scheduler.schedule()
        assert plan.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        bound = scheduler.config.max_running_seqs_per_tenant
        if bound is not None:
            assert max(Counter(r.tenant_id for r in scheduler.running).values(), default=0) <= bound
        self.num_steps += 1
        self.num_preemptions += scheduler.make_stats().num_preemptions
        self.plans.append(dict(plan.num_scheduled_tokens))
        self.prompt_tokens_per_step.append(Counter())
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            if request.num_tokens - request.num_computed_tokens > 1:
                self.prompt_tokens_per_step[-1][request.tenant_id] += num_tokens
        for new in plan.scheduled_new_reqs:
            if new.request_id not in self.admitted_at:
                self.admitted_at[new.request_id] = self.num_steps
                self.admission_order.append(new.request_id)
        if plan.is_empty:
            return plan
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            self.tenant_to_num_computed[tenant_of[req_id]] += num_tokens
        for output in scheduler.update_from_output(plan, self.executor.execute_model(plan)):
            self.tenant_to_num_sampled[tenant_of[output.request_id]] += len(output.new_token_ids)
            self.request_to_tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        return plan

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def check_outputs(self, max_tokens: dict[str, int]) -> None:
        """Every request got exactly the fake model's continuation (nothing lost to preemption)."""
        for req_id, prompt in self.prompts.items():
            expected = reference_continuation(prompt, max_tokens[req_id])
            assert self.request_to_tokens[req_id] == expected, req_id


def make_harness(num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 4,
                 max_num_batched_tokens: int = 64, policy: str = "fair",
                 tenant_weights: tuple[tuple[str, float], ...] = (),
                 max_running_seqs_per_tenant: int | None = None,
                 enable_caching: bool = False, max_prefill_tokens_over_share: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> Harness:
    config = SchedulerConfig(max_model_len=256, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, policy=policy,
                             tenant_weights=tenant_weights,
                             max_running_seqs_per_tenant=max_running_seqs_per_tenant,
                             max_prefill_tokens_over_share=max_prefill_tokens_over_share)
    return Harness(Scheduler(config, num_blocks, block_size, enable_caching, clock=clock),
                   FakeExecutor(num_blocks, block_size))
