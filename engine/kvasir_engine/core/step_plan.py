"""`StepPlan`: one step's plan while the scheduler builds it, and the fair-share decisions it
is built under.

`Scheduler.schedule()` fills a `StepPlan` in two phases (running requests, then waiting ones)
and turns it into the plain `SchedulerOutput`. The plan owns its budgets: the step's token
budget (`--max-num-batched-tokens`) and the prompt tokens left for requests beyond their
tenant's share (`--max-prefill-tokens-over-share`), so a request that leaves the plan again
(preempted by a later one's allocation) gives back exactly what it took. `FairShareDecisions`
is what `FairShare` decided for the step before planning starts, handed in as data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvasir_engine.core.outputs import CachedRequestData, NewRequestData
from kvasir_engine.core.request import Request


@dataclass(frozen=True)
class FairShareDecisions:
    """What the fair share decided for this step, before it is planned."""

    # A newcomer whose prefill runs alone this step (`FairShare.first_token_request`), or None.
    alone: Request | None
    # {tenant: rank among its running requests from which prompt tokens are capped}
    # (`FairShare.prefill_cap_shares`); tenants not named are never capped.
    cap_shares: dict[str, float]

    def is_capped(self, tenant_id: str, rank: int) -> bool:
        return rank >= self.cap_shares.get(tenant_id, float("inf"))


@dataclass
class StepPlan:
    token_budget: int
    capped_budget: int  # prompt tokens left for requests beyond their tenant's share
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Of the planned requests, the capped ones' tokens (given back if they leave the plan).
    req_to_num_capped: dict[str, int] = field(default_factory=dict)

    def add(self, request_id: str, num_tokens: int, *, is_capped: bool,
            drafts: list[int] | None = None) -> None:
        self.num_scheduled_tokens[request_id] = num_tokens
        self.token_budget -= num_tokens
        if is_capped:
            self.capped_budget -= num_tokens
            self.req_to_num_capped[request_id] = num_tokens
        if drafts:
            self.spec_token_ids[request_id] = drafts

    def drop(self, request_id: str) -> None:
        """A planned request was preempted after all: it leaves the plan with its budget."""
        num_tokens = self.num_scheduled_tokens.pop(request_id, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        self.capped_budget += self.req_to_num_capped.pop(request_id, 0)
        self.spec_token_ids.pop(request_id, None)
        self.cached_reqs = [c for c in self.cached_reqs if c.request_id != request_id]
