"""`Scheduler`: continuous batching over a token budget, in vLLM v1's shape.

Each step it decides `{request_id: num_tokens}`: running requests first (a decode is 1 token, an
unfinished prompt continues with its next chunk), then waiting ones in the order `FairShare`
picks (the least-served tenant's oldest request under `fair`, the oldest of all under `fcfs`),
within `max_num_seqs` running requests and `max_num_batched_tokens` tokens; under `fair`, when
every slot is taken, a waiting tenant below its share of them first takes one from a tenant
above its own (`FairShare.slot_victim_index`), and a tenant's first request that arrives while
only others run gets a step of its own (`FairShare.first_token_request`: its prefill alone, never
two such steps in a row); and while a tenant below its share is present, the tenants above theirs
get at most `max_prefill_tokens_over_share` prompt tokens a step for their requests beyond it
(`FairShare.prefill_cap_shares`).

Interjection (`fair`, `interject_first_tokens`): such a first token need not wait for the step
in flight to end either. The engine thread runs a step's forward pass a decoder layer at a time
(`EngineCore.begin_step`); between two layers it adds what arrived and calls
`schedule_interjection`, whose plan runs there, and then the step's next layer. The rules: it never preempts (the step in flight writes its requests' blocks), never takes a
prefix-cache hit on a block that step is writing (blocks are keyed in the cache when allocated,
before they are computed), and the prompts interjected into one step add at most
`max_num_batched_tokens` tokens to it, each whole. Several newcomers a few milliseconds apart
all cut in (the second one would otherwise wait for the rest of a step lengthened by the
first one's prefill, then for a mixed step, since the step after an interjection is never a
lone one); so does a newcomer arriving during another's lone step. Slots taken beyond
`max_num_seqs` go back at the next `schedule()`: the latest request of the most served
tenant above its share is preempted, as the slot rule would have done before a lone step.

Prefill and decode are just token counts. When
the KV cache runs out, a running request is preempted (`FairShare` chooses which): its blocks
are freed and it goes back to the front of its tenant's queue, to be recomputed later from all
its tokens (its outputs are kept). With speculative decoding a decoding request that has draft
tokens computes 1 + k tokens; after the step only the accepted drafts stay computed and the
blocks of rejected ones go back to the pool (`SpecDecodePolicy` decides who proposes). A pure
CPU function of its state (docs/architecture.md, rule 4): tests drive it with a fake block count and hand-written `ModelRunnerOutput`s.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable

from kvasir_engine.config import SchedulerConfig, SpeculativeConfig
from kvasir_engine.core.fair_share import FairShare
from kvasir_engine.core.limits import FitError, fit_error, queue_full
from kvasir_engine.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from kvasir_engine.core.remote_kv import hold_for_consumer, num_loaded_tokens_of, take_kv_load
from kvasir_engine.core.request import LogprobsEntry, Request, RequestStatus
from kvasir_engine.core.spec_policy import (
    SpecDecodePolicy,
    SpecStepCounts,
    drafts_to_verify,
    num_accepted_drafts,
)
from kvasir_engine.core.step_plan import FairShareDecisions, StepPlan
from kvasir_engine.kv.block import KVCacheBlocks
from kvasir_engine.kv.kv_cache_manager import KVCacheManager


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_kv_blocks: int, block_size: int,
                 enable_caching: bool, speculative: SpeculativeConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock  # the requests' timestamps and who is present (FairShare)
        self.max_model_len = config.max_model_len
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, block_size, enable_caching,
                                               config.max_model_len)
        self.requests: dict[str, Request] = {}
        self.fair_share = FairShare(config)
        self.waiting = self.fair_share.waiting  # read here, changed through fair_share only
        # In admission order (under fcfs the last one is the first to be preempted).
        self.running: list[Request] = []
        # Requests the runner must forget, sent with the next non-empty step.
        self.finished_req_ids: set[str] = set()
        self._num_step_preemptions = 0
        self._num_step_scheduled_tokens = 0
        self._num_step_scheduled_reqs = 0
        self._was_first_token_step = False  # the last step ran one newcomer's prefill alone
        # The plan whose forward pass runs now (from schedule() to its update_from_output).
        self._in_flight: SchedulerOutput | None = None
        self._num_interjected_tokens = 0  # prompt tokens interjected into the step in flight
        self.spec_policy = SpecDecodePolicy(speculative) if speculative is not None else None

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it can never fit, QueueFullError if the queue is."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id}: status must be WAITING, "
                             f"got {request.status.name}")
        never = self.fit_error(request.num_prompt_tokens, request.sampling_params.max_tokens)
        if never is not None:
            raise ValueError(never.message)
        full = queue_full(len(self.running) + len(self.waiting), 1, self.config.max_num_seqs,
                          self.config.max_queue_len)
        if full is not None:
            raise full
        self.requests[request.request_id] = request
        self.fair_share.add_waiting(request)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); their blocks are freed at once.

        Unknown or already finished ids are ignored: a request may finish on its own first.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished one, got {status.name}")
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.fair_share.remove_waiting(request)
            self._free_request(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        """The next step's plan: slots given back, then the running requests, then the waiting
        ones, under the fair share's decisions for the step."""
        is_spec_on = self._start_step()
        self._give_back_slots()
        num_slot_preemptions = self._num_step_preemptions
        decisions = self._decide_fair_share()
        plan = StepPlan(self.config.max_num_batched_tokens,
                        self.config.max_prefill_tokens_over_share)
        if decisions.alone is None:
            self._plan_running(plan, decisions, is_spec_on)
        # A step that had to preempt is short of blocks: admitting more would only thrash.
        if self._num_step_preemptions == num_slot_preemptions:
            self._plan_waiting(plan, decisions)
        return self._finish_plan(plan, is_spec_on)

    def _start_step(self) -> bool:
        """Resets the step's counters; whether speculation runs for this batch."""
        self._num_step_preemptions = 0
        if self.spec_policy is None:
            return False
        self.spec_policy.start_step()
        return self.spec_policy.is_batch_on(len(self.running))

    def _give_back_slots(self) -> None:
        # An interjected first token took a slot beyond the bound: one goes back.
        while len(self.running) > self.config.max_num_seqs:
            self._preempt(self.running.pop(self.fair_share.excess_slot_index(self.running)))
        # One slot a step: the freed slot goes to the tenant next in line, below its share.
        if (len(self.running) >= self.config.max_num_seqs
                and (index := self.fair_share.slot_victim_index(self.running)) is not None):
            self._preempt(self.running.pop(index))

    def _decide_fair_share(self) -> FairShareDecisions:
        alone = (None if self._was_first_token_step
                 or len(self.running) >= self.config.max_num_seqs
                 else self.fair_share.first_token_request(self.running))
        self._was_first_token_step = alone is not None
        return FairShareDecisions(alone, self.fair_share.prefill_cap_shares(self._clock()))

    def _plan_running(self, plan: StepPlan, decisions: FairShareDecisions,
                      is_spec_on: bool) -> None:
        """Running requests in order: each decode's token (and drafts to verify), each
        unfinished prompt's next chunk, preempting others when blocks run out. Decodes are
        never starved by a long prompt: a request is only admitted with budget to spare, so
        unfinished prefills always sit at the tail of `running`."""
        num_ranked: Counter[str] = Counter()  # a running request's rank within its tenant
        for request in list(self.running):
            if plan.token_budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop, for another's blocks
            num_left = request.num_tokens - request.num_computed_tokens
            num_new_tokens = min(num_left, plan.token_budget)
            is_capped = num_left > 1 and decisions.is_capped(request.tenant_id,
                                                             num_ranked[request.tenant_id])
            num_ranked[request.tenant_id] += 1
            if is_capped:
                num_new_tokens = min(num_new_tokens, plan.capped_budget)
                if num_new_tokens == 0:
                    continue
            drafts = drafts_to_verify(request, plan.token_budget, is_spec_on,
                                      self.max_model_len)
            num_new_tokens += len(drafts)
            new_blocks, victims = self._allocate_or_preempt(request, num_new_tokens)
            for victim in victims:  # one already planned this step leaves the plan again
                plan.drop(victim.request_id)
            if new_blocks is None:
                break  # it preempted itself: memory is short, the rest wait for the next step
            num_held_blocks = (self.kv_cache_manager.num_blocks(request.request_id)
                               - len(new_blocks.blocks))
            plan.cached_reqs.append(CachedRequestData(
                request.request_id, new_blocks.get_block_ids(), request.num_computed_tokens,
                num_held_blocks))
            plan.add(request.request_id, num_new_tokens, is_capped=is_capped, drafts=drafts)
        for request in self.running:
            if request.request_id in plan.num_scheduled_tokens:
                self.fair_share.charge_computed(request,
                                                plan.num_scheduled_tokens[request.request_id])

    def _plan_waiting(self, plan: StepPlan, decisions: FairShareDecisions) -> None:
        """Waiting requests in the fair share's order, while slots, budget and blocks last;
        nobody overtakes the request the policy picked."""
        kv = self.kv_cache_manager
        now = self._clock()
        while (self.waiting and plan.token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = decisions.alone or self.fair_share.next_waiting()
            if request is None:
                break  # nobody waits, or every waiting tenant is at its running bound
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_loaded_tokens = num_loaded_tokens_of(request.kv_load, num_hit_tokens,
                                                     kv.block_size)
            num_new_tokens = min(request.num_tokens - num_hit_tokens - num_loaded_tokens,
                                 plan.token_budget)
            is_capped = decisions.is_capped(request.tenant_id,
                                            self.fair_share.num_running(request.tenant_id))
            if is_capped:
                num_new_tokens = min(num_new_tokens, plan.capped_budget)
            if num_new_tokens == 0 or kv.allocate_slots(
                    request, num_loaded_tokens + num_new_tokens, hit_blocks) is None:
                break
            plan.new_reqs.append(self._admit(request, num_hit_tokens, num_new_tokens, now,
                                             num_loaded_tokens))
            plan.add(request.request_id, num_new_tokens, is_capped=is_capped)
            if decisions.alone is not None:
                break

    def _finish_plan(self, plan: StepPlan, is_spec_on: bool) -> SchedulerOutput:
        num_scheduled = plan.num_scheduled_tokens
        total = sum(num_scheduled.values())
        num_to_propose = (self.spec_policy.num_to_propose_after(self.requests, num_scheduled,
                                                                self.max_model_len)
                          if is_spec_on and self.spec_policy is not None
                          and self.spec_policy.is_batch_on(len(self.running)) else {})
        scheduler_output = SchedulerOutput(plan.new_reqs, plan.cached_reqs, num_scheduled, total,
                                           set(self.finished_req_ids), plan.spec_token_ids,
                                           num_to_propose)
        if total > 0:  # an empty plan is not executed: keep them for later
            self.finished_req_ids.clear()
            self._in_flight, self._num_interjected_tokens = scheduler_output, 0
        self._num_step_scheduled_tokens = total
        self._num_step_scheduled_reqs = len(num_scheduled)
        return scheduler_output

    def schedule_interjection(self) -> SchedulerOutput | None:
        """A plan of one first token to run while the step in flight waits between two
        decoder layers (the module's "Interjection"), or None when nobody should cut in.

        Called between `schedule()` and its `update_from_output`, as often as the caller has
        newcomers; each plan's own `update_from_output` follows before the next call. It
        never preempts (the step in flight writes its requests' blocks), so its request may
        hold a running slot beyond `max_num_seqs` until the next `schedule()` gives one back.
        """
        in_flight = self._in_flight
        if not self.config.interject_first_tokens or in_flight is None:
            return None
        request = self.fair_share.first_token_request(self.running)
        if request is None or request.kv_load is not None:
            return None  # received K/V is written at a step's start, not between two layers
        kv = self.kv_cache_manager
        hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
        num_new_tokens = request.num_tokens - num_hit_tokens
        # A hit on a block the step in flight is still writing would read it half computed.
        if (num_new_tokens > self.config.max_num_batched_tokens - self._num_interjected_tokens
                or not self._blocks_written_by(in_flight).isdisjoint(
                    hit_blocks.get_block_ids())
                or kv.allocate_slots(request, num_new_tokens, hit_blocks) is None):
            return None
        new_req = self._admit(request, num_hit_tokens, num_new_tokens, self._clock())
        self._num_interjected_tokens += num_new_tokens
        self._was_first_token_step = True  # the next step is not another prefill alone
        self._num_step_scheduled_tokens += num_new_tokens  # counted with the step in flight
        self._num_step_scheduled_reqs += 1
        return SchedulerOutput([new_req], [], {request.request_id: num_new_tokens},
                               num_new_tokens)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, apply stop checks, free finished."""
        if scheduler_output is self._in_flight:
            self._in_flight = None
        req_id_to_index = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        outputs: list[EngineCoreOutput] = []
        now = self._clock()
        num_finished = 0
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished from outside since the plan was made
            request.num_computed_tokens += num_tokens
            index = req_id_to_index.get(req_id)
            sampled = model_runner_output.sampled_token_ids[index] if index is not None else []
            drafts = scheduler_output.scheduled_spec_token_ids.get(req_id, [])
            if drafts and self.spec_policy is not None:
                num_accepted = num_accepted_drafts(req_id, drafts, sampled)
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_policy.record(req_id, len(drafts), num_accepted)
            if request.num_computed_tokens < request.num_tokens:
                if sampled:
                    raise RuntimeError(f"request {req_id}: the model runner sampled tokens after "
                                       f"a partial prefill chunk")
                continue
            if not sampled:
                raise RuntimeError(f"request {req_id}: all its tokens were computed but the model "
                                   f"runner sampled no token")
            logprobs = (model_runner_output.logprobs[index]
                        if index is not None and index < len(model_runner_output.logprobs)
                        else None)
            output = self._append_tokens(request, sampled, logprobs, now)
            self.fair_share.charge_output(request, len(output.new_token_ids))
            if not output.is_finished:
                if drafts:  # the rejected drafts' slots are free again
                    self.kv_cache_manager.trim(request, request.num_computed_tokens)
                if index is not None and index < len(model_runner_output.spec_token_ids):
                    request.spec_token_ids = list(model_runner_output.spec_token_ids[index])
            if index is not None and index < len(model_runner_output.prompt_logprobs):
                prompt_logprobs = model_runner_output.prompt_logprobs[index]
                if prompt_logprobs is not None:
                    output = dataclasses.replace(output, prompt_logprobs=prompt_logprobs)
            num_finished += output.is_finished
            outputs.append(output)
        if num_finished:
            self.running = [request for request in self.running if not request.is_finished]
        return outputs

    def fail_plan(self, scheduler_output: SchedulerOutput,
                  failed_req_ids: Collection[str]) -> list[EngineCoreOutput]:
        """The executor could not run this plan because of `failed_req_ids`' own data
        (`RequestError`): they finish with FINISHED_ERROR; every other request of the plan is
        preempted, so the runner forgets what it did for it and it is recomputed. Blocks the
        plan was to write leave the prefix cache first: their contents were never computed."""
        if scheduler_output is self._in_flight:
            self._in_flight = None
        outputs: list[EngineCoreOutput] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.kv_cache_manager.uncache_uncomputed(request)
            self.running.remove(request)
            if req_id in failed_req_ids:
                self._free_request(request, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(
                    request_id=req_id, new_token_ids=[], finish_reason="error",
                    num_cached_tokens=max(request.num_cached_tokens, 0)))
            else:
                self._preempt(request)
        return outputs

    def make_stats(self) -> SchedulerStats:
        """A snapshot after a step; call once per step (prefix-cache counts are per step)."""
        kv = self.kv_cache_manager
        spec = self.spec_policy.step_counts if self.spec_policy is not None else SpecStepCounts()
        prefix_stats = kv.make_prefix_cache_stats()
        num_blocks_in_use = kv.block_pool.num_usable_blocks - kv.num_free_blocks
        num_unfilled_slots = sum(kv.num_unfilled_slots(request) for request in self.running)
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage, prefix_cache_queries=prefix_stats.num_queries,
            prefix_cache_hits=prefix_stats.num_hits, num_preemptions=self._num_step_preemptions,
            num_scheduled_tokens=self._num_step_scheduled_tokens,
            num_scheduled_reqs=self._num_step_scheduled_reqs,
            num_kv_blocks_in_use=num_blocks_in_use,
            num_kv_tokens_stored=num_blocks_in_use * kv.block_size - num_unfilled_slots,
            num_spec_drafts=spec.num_drafts, num_spec_draft_tokens=spec.num_draft_tokens,
            num_spec_accepted_tokens=sum(spec.num_accepted_per_pos),
            num_spec_accepted_tokens_per_pos=tuple(spec.num_accepted_per_pos))

    def fit_error(self, num_prompt_tokens: int, max_tokens: int) -> FitError | None:
        """`core/limits.fit_error` for this scheduler's context length and KV cache; it reads
        only what is fixed at start-up, so any thread may call it."""
        return fit_error(num_prompt_tokens, max_tokens, self.max_model_len,
                         self.kv_cache_manager)

    def _admit(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
               now: float, num_loaded_tokens: int = 0) -> NewRequestData:
        """A waiting request whose blocks are allocated joins the running ones."""
        self.fair_share.remove_waiting(request)
        self.running.append(request)
        self.fair_share.on_running(request.tenant_id, +1)
        request.status = RequestStatus.RUNNING
        kv_load = take_kv_load(request, self.kv_cache_manager, num_hit_tokens,
                               num_loaded_tokens)
        request.num_computed_tokens = num_hit_tokens + num_loaded_tokens
        self.fair_share.charge_computed(request, num_new_tokens)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        return NewRequestData(
            request_id=request.request_id, token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens, sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            num_output_tokens=request.num_output_tokens, kv_load=kv_load)

    def _blocks_written_by(self, plan: SchedulerOutput) -> set[int]:
        """The KV blocks a plan's forward pass writes (its requests' next tokens' slots)."""
        kv = self.kv_cache_manager
        block_ids: set[int] = set()
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                start = request.num_computed_tokens
                block_ids.update(kv.get_block_ids(req_id)[
                    start // kv.block_size:kv.num_blocks_for(start + num_tokens)])
        return block_ids

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int
                             ) -> tuple[KVCacheBlocks | None, list[Request]]:
        """Blocks for a running request, preempting others until they fit; and the preempted.

        The blocks are None when the request had to preempt itself.
        """
        victims: list[Request] = []
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks, victims
            victim = self.running.pop(self.fair_share.victim_index(self.running))
            self._preempt(victim)
            victims.append(victim)
            if victim is request:
                return None, victims

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        self.kv_cache_manager.free(request)
        self.fair_share.on_running(request.tenant_id, -1)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_step_preemptions += 1
        self.finished_req_ids.add(request.request_id)  # the runner drops its state
        self.fair_share.add_waiting(request, front=True)

    def _append_tokens(self, request: Request, sampled: list[int],
                       logprobs: list[LogprobsEntry] | None, now: float) -> EngineCoreOutput:
        """Append sampled tokens one by one, stopping at the first stop condition."""
        status: RequestStatus | None = None
        stop_reason: int | None = None
        num_appended = 0
        for token_id in sampled:
            entry = [logprobs[num_appended]] if logprobs else None
            request.append_output_token_ids([token_id], entry)
            num_appended += 1
            status, stop_reason = request.stop_status(self.max_model_len)
            if status is not None:
                break
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        kv_hold = None
        if status is not None:
            if request.do_remote_decode:  # a producer's: its consumer fetches the blocks
                kv_hold = hold_for_consumer(request, self.kv_cache_manager)
            self._free_request(request, status, now)
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=sampled[:num_appended],
            new_logprobs=logprobs[:num_appended] if logprobs else None,
            finish_reason=status.finish_reason if status is not None else None,
            stop_reason=stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0),
            kv_hold=kv_hold)

    def _free_request(self, request: Request, status: RequestStatus,
                      now: float | None = None) -> None:
        """Finish a request already taken out of (or about to leave) the queues."""
        if request.status == RequestStatus.RUNNING:
            self.finished_req_ids.add(request.request_id)
            self.fair_share.on_running(request.tenant_id, -1)
        request.status = status
        request.finished_time = self._clock() if now is None else now
        self.kv_cache_manager.free(request)
        if self.spec_policy is not None:
            self.spec_policy.forget(request.request_id)
        del self.requests[request.request_id]
