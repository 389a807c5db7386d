"""`SpecDecodePolicy`: whether speculative decoding pays, per request and per step.

Verifying k draft tokens costs a forward pass over 1 + k tokens instead of 1; it pays when the
accepted drafts outweigh that cost. Two things decide it (docs/speculative.md):

- the batch: while `disable_by_batch_size` or more requests run, a step is compute-bound and
  the extra rows cost about what they save, so nobody proposes; proposing resumes as soon as
  the batch is smaller again;
- the request: its acceptance rate (accepted / proposed draft tokens, an exponentially weighted
  average over its verifications) below `min_acceptance_rate` turns its proposals off; it
  probes again after a number of its steps that doubles after every failed probe (so a request
  of free text costs a verification now and then, never one a step), and a probe at or above
  the break-even turns it back on.

Torch-free and pure, like the scheduler that consults it (docs/architecture.md, rule 4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvasir_engine.config import SpeculativeConfig
from kvasir_engine.core.request import Request

# Weight of the newest verification in a request's acceptance average.
ACCEPTANCE_EWMA_WEIGHT = 0.3
# A new request's acceptance before its first verification: above the default break-even, so
# every request tries, below 1, so two bad verifications are enough to turn it off.
INITIAL_ACCEPTANCE = 0.5
# Steps of a request between its being turned off and its first probe, and the cap of the
# doubling.
FIRST_PROBE_AFTER_STEPS = 8
MAX_PROBE_AFTER_STEPS = 256


@dataclass
class _Acceptance:
    rate: float = INITIAL_ACCEPTANCE
    is_on: bool = True
    is_probing: bool = False
    steps_until_probe: int = 0
    probe_after_steps: int = FIRST_PROBE_AFTER_STEPS


@dataclass
class SpecStepCounts:
    """Verifications within one step, for its `SchedulerStats` (vLLM's spec-decode counters)."""

    num_drafts: int = 0  # requests that verified drafts
    num_draft_tokens: int = 0
    num_accepted_per_pos: list[int] = field(default_factory=list)  # index 0: first draft


class SpecDecodePolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._requests: dict[str, _Acceptance] = {}
        self.step_counts = SpecStepCounts()

    def start_step(self) -> None:
        self.step_counts = SpecStepCounts()

    def is_batch_on(self, num_running_reqs: int) -> bool:
        """Whether a step of this many running requests proposes and verifies at all."""
        bound = self.config.disable_by_batch_size
        return bound is None or num_running_reqs < bound

    def num_to_propose(self, request_id: str, num_useful: int) -> int:
        """Draft tokens the request should get after this step (once per request a step);
        `num_useful` bounds it (tokens the request may still emit beyond the next one)."""
        state = self._requests.setdefault(request_id, _Acceptance())
        if not state.is_on:
            state.steps_until_probe -= 1
            if state.steps_until_probe > 0:
                return 0
            # Its verification is recorded before the call after next; if the proposer found
            # nothing to propose, that call probes again.
            state.is_probing, state.steps_until_probe = True, 2
        return max(0, min(self.config.num_speculative_tokens, num_useful))

    def record(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification of the request's drafts."""
        if num_draft_tokens < 1:
            return
        counts = self.step_counts
        counts.num_drafts += 1
        counts.num_draft_tokens += num_draft_tokens
        counts.num_accepted_per_pos += [0] * (num_draft_tokens - len(counts.num_accepted_per_pos))
        for pos in range(num_accepted):
            counts.num_accepted_per_pos[pos] += 1
        state = self._requests.setdefault(request_id, _Acceptance())
        observed = num_accepted / num_draft_tokens
        if state.is_probing:  # the first fresh look after a pause decides alone
            state.rate, state.is_probing = observed, False
        else:
            state.rate += ACCEPTANCE_EWMA_WEIGHT * (observed - state.rate)
        if state.rate >= self.config.min_acceptance_rate:
            state.is_on, state.probe_after_steps = True, FIRST_PROBE_AFTER_STEPS
        elif state.is_on:
            state.is_on, state.steps_until_probe = False, state.probe_after_steps
        else:  # a failed probe: wait twice as long for the next one
            state.probe_after_steps = min(2 * state.probe_after_steps, MAX_PROBE_AFTER_STEPS)
            state.steps_until_probe = state.probe_after_steps

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def num_to_propose_after(self, requests: Mapping[str, Request],
                             num_scheduled_tokens: dict[str, int],
                             max_model_len: int) -> dict[str, int]:
        """{request_id: draft tokens to propose after this step} for the requests that sample."""
        out: dict[str, int] = {}
        for req_id, num_tokens in num_scheduled_tokens.items():
            request = requests[req_id]
            if request.num_computed_tokens + num_tokens < request.num_tokens:
                continue  # a partial prefill chunk samples nothing
            # After this step it has at least one more output; the next one is never a draft.
            num_useful = min(request.sampling_params.max_tokens - request.num_output_tokens - 2,
                             max_model_len - request.num_tokens - 1)
            num = self.num_to_propose(req_id, num_useful)
            if num > 0:
                out[req_id] = num
        return out


def drafts_to_verify(request: Request, token_budget: int, is_spec_on: bool,
                     max_model_len: int) -> list[int]:
    """The request's draft tokens to verify this step, taken off it: none unless it decodes
    (one known token left to compute) and the batch is on; never more than the budget,
    max_tokens or max_model_len leave room for."""
    drafts, request.spec_token_ids = request.spec_token_ids, []
    if not drafts or not is_spec_on or request.num_computed_tokens != request.num_tokens - 1:
        return []
    num_room = min(token_budget - 1,
                   request.sampling_params.max_tokens - request.num_output_tokens - 1,
                   max_model_len - request.num_tokens)
    return drafts[:max(num_room, 0)]


def num_accepted_drafts(req_id: str, drafts: list[int], sampled: list[int]) -> int:
    """Drafts accepted by a verification: the runner answers them and one token more."""
    num_accepted = len(sampled) - 1
    if not 0 <= num_accepted <= len(drafts) or sampled[:num_accepted] != drafts[:num_accepted]:
        raise RuntimeError(f"request {req_id}: {len(drafts)} drafts verified into {sampled}, "
                           f"which is not the accepted drafts and one token more")
    return num_accepted
