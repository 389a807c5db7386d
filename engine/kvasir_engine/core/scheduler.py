"""`Scheduler`: continuous batching over a token budget, in vLLM v1's shape.

Each step it decides `{request_id: num_tokens}`: running requests first (a decode is 1 token, an
unfinished prompt continues with its next chunk), then waiting ones in the order `FairShare`
picks (the least-served tenant's oldest request under `fair`, the oldest of all under `fcfs`),
within `max_num_seqs` running requests and `max_num_batched_tokens` tokens; under `fair`, when
every slot is taken, a waiting tenant below its share of them first takes one from a tenant
above its own (`FairShare.slot_victim_index`), and a tenant's first request that arrives while
only others run gets a step of its own (`FairShare.first_token_request`: its prefill alone, never
two such steps in a row). Prefill and decode are just token counts. When
the KV cache runs out, a running request is preempted (`FairShare` chooses which): its blocks
are freed and it goes back to the front of its tenant's queue, to be recomputed later from all
its tokens (its outputs are kept). A pure CPU function of its state (docs/architecture.md,
rule 4): tests drive it with a fake block count and hand-written `ModelRunnerOutput`s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from kvasir_engine.config import SchedulerConfig
from kvasir_engine.core.fair_share import FairShare
from kvasir_engine.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from kvasir_engine.core.request import LogprobsEntry, Request, RequestStatus
from kvasir_engine.kv.block import KVCacheBlocks
from kvasir_engine.kv.kv_cache_manager import KVCacheManager


class QueueFullError(RuntimeError):
    """A queue bound is reached: the scheduler's `--max-queue-len`, or one the server counts
    (admission.py); admitting is possible once others finish (the API answers 429 with
    Retry-After). The message names the bound."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_kv_blocks: int, block_size: int,
                 enable_caching: bool) -> None:
        self.config = config
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

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it can never fit, QueueFullError if the queue is."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id}: status must be WAITING, "
                             f"got {request.status.name}")
        never = self.fit_error(request.num_prompt_tokens, request.sampling_params.max_tokens)
        if never is not None:
            raise ValueError(never)
        max_queue_len = self.config.max_queue_len
        # A request that takes a free running slot at the next step is not waiting.
        num_free_slots = max(0, self.config.max_num_seqs - len(self.running))
        if max_queue_len is not None and len(self.waiting) >= max_queue_len + num_free_slots:
            raise QueueFullError(f"the waiting queue is full ({max_queue_len} requests, "
                                 f"--max-queue-len)")
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
        kv = self.kv_cache_manager
        token_budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        cached_reqs: list[CachedRequestData] = []
        new_reqs: list[NewRequestData] = []
        self._num_step_preemptions = 0
        # One slot a step: the freed slot goes to the tenant next in line, below its share.
        if (len(self.running) >= self.config.max_num_seqs
                and (index := self.fair_share.slot_victim_index(self.running)) is not None):
            self._preempt(self.running.pop(index))
        num_slot_preemptions = self._num_step_preemptions
        alone = (None if self._was_first_token_step or len(self.running) >= self.config.max_num_seqs
                 else self.fair_share.first_token_request(self.running))
        self._was_first_token_step = alone is not None

        req_index = 0
        while alone is None and req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            # Decodes are never starved by a long prompt: a request can only be admitted with
            # budget to spare, so unfinished prefills always sit at the tail of `running`.
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            new_blocks, victims = self._allocate_or_preempt(request, num_new_tokens)
            for victim in victims:  # one already planned this step leaves the plan again
                if victim.request_id in num_scheduled_tokens:
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    cached_reqs = [c for c in cached_reqs if c.request_id != victim.request_id]
                    req_index -= 1
            if new_blocks is None:
                break  # it preempted itself: memory is short, the rest wait for the next step
            cached_reqs.append(CachedRequestData(request.request_id, new_blocks.get_block_ids(),
                                                 request.num_computed_tokens))
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
        for request in self.running[:req_index]:
            self.fair_share.charge_computed(request, num_scheduled_tokens[request.request_id])

        # A step that had to preempt is short of blocks: admitting more would only thrash.
        now = time.monotonic()
        while (self._num_step_preemptions == num_slot_preemptions and self.waiting
               and token_budget > 0 and len(self.running) < self.config.max_num_seqs):
            next_request = alone or self.fair_share.next_waiting()
            if next_request is None:
                break  # nobody waits, or every waiting tenant is at its running bound
            request = next_request
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_hit_tokens, token_budget)
            if kv.allocate_slots(request, num_new_tokens, hit_blocks) is None:
                break  # nobody overtakes the request the policy picked
            self.fair_share.remove_waiting(request)
            self.running.append(request)
            self.fair_share.on_running(request.tenant_id, +1)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            self.fair_share.charge_computed(request, num_new_tokens)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            new_reqs.append(NewRequestData(
                request_id=request.request_id, token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=kv.get_block_ids(request.request_id),
                num_computed_tokens=num_hit_tokens, num_output_tokens=request.num_output_tokens))
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            if alone is not None:
                break

        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        scheduler_output = SchedulerOutput(new_reqs, cached_reqs, num_scheduled_tokens,
                                           total_num_scheduled_tokens, set(self.finished_req_ids))
        if total_num_scheduled_tokens > 0:  # an empty plan is not executed: keep them for later
            self.finished_req_ids.clear()
        self._num_step_scheduled_tokens = total_num_scheduled_tokens
        self._num_step_scheduled_reqs = len(num_scheduled_tokens)
        return scheduler_output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, apply stop checks, free finished."""
        req_id_to_index = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        num_finished = 0
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished from outside since the plan was made
            request.num_computed_tokens += num_tokens
            index = req_id_to_index.get(req_id)
            sampled = model_runner_output.sampled_token_ids[index] if index is not None else []
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
            if index is not None and index < len(model_runner_output.prompt_logprobs):
                prompt_logprobs = model_runner_output.prompt_logprobs[index]
                if prompt_logprobs is not None:
                    output = dataclasses.replace(output, prompt_logprobs=prompt_logprobs)
            num_finished += output.is_finished
            outputs.append(output)
        if num_finished:
            self.running = [request for request in self.running if not request.is_finished]
        return outputs

    def make_stats(self) -> SchedulerStats:
        """A snapshot after a step; call once per step (prefix-cache counts are per step)."""
        kv = self.kv_cache_manager
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
            num_kv_tokens_stored=num_blocks_in_use * kv.block_size - num_unfilled_slots)

    def fit_error(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size could never be scheduled, naming the numbers; None if it
        can be (now or once others finish). The one "can this ever fit" check: `add_request`
        raises it as a ValueError, the server answers it with a 400 before queueing.

        It reads only what is fixed at start-up, so any thread may call it.
        """
        num_total = num_prompt_tokens + max_tokens
        if num_total > self.max_model_len:
            return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                    f"{num_total} tokens exceeds max_model_len ({self.max_model_len})")
        kv = self.kv_cache_manager
        # The last sampled token is never fed back, so it needs no KV slot.
        if not kv.can_ever_hold(num_total - 1):
            return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
                    f"{kv.num_blocks_for(num_total - 1)} KV blocks of {kv.block_size} tokens, but "
                    f"the whole KV cache has {kv.block_pool.num_usable_blocks} blocks "
                    f"({kv.max_num_tokens} tokens)")
        return None

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
            status, stop_reason = self._check_stop(request)
            if status is not None:
                break
        if request.first_token_time is None:
            request.first_token_time = now
        if status is not None:
            self._free_request(request, status, now)
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=sampled[:num_appended],
            new_logprobs=logprobs[:num_appended] if logprobs else None,
            finish_reason=status.finish_reason if status is not None else None,
            stop_reason=stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0))

    def _check_stop(self, request: Request) -> tuple[RequestStatus | None, int | None]:
        """(finished status, stop token id) after the last appended token; (None, None) if not."""
        params = request.sampling_params
        last_token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last_token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if last_token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, last_token_id
        if (request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return None, None

    def _free_request(self, request: Request, status: RequestStatus,
                      now: float | None = None) -> None:
        """Finish a request already taken out of (or about to leave) the queues."""
        if request.status == RequestStatus.RUNNING:
            self.finished_req_ids.add(request.request_id)
            self.fair_share.on_running(request.tenant_id, -1)
        request.status = status
        request.finished_time = time.monotonic() if now is None else now
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
