"""`FairShare`: the waiting queue by tenant, which request runs next, which one is preempted.

With FCFS a tenant that floods the queue delays every other tenant's first token by its whole
backlog. The virtual token counter (VTC) of Sheng et al., "Fairness in Serving Large Language
Models" (OSDI 2024) keeps, per tenant, the weighted service it has received: prompt tokens
computed x W_PROMPT plus output tokens generated x W_OUTPUT, divided by the tenant's weight
(`--tenant-weight`, 1 by default). When a slot frees up it admits the oldest waiting request of
the backlogged tenant with the smallest counter, with one refinement for the running slots
(`--max-num-seqs`) below. With one tenant that is exactly FCFS.

- Counters are charged from what each step computes (the scheduler calls `charge_computed` with
  every planned chunk and `charge_output` with every sampled token), not from the prompt's length
  at admission: a chunked prefill is paid chunk by chunk, prefix-cache hits cost nothing, and the
  recomputation after a preemption is paid again, as it is compute the tenant's requests took.
- No credit banking: a tenant that becomes backlogged (its first waiting request) is lifted to the
  smallest counter of the other backlogged tenants or, when none is, to the counter of the tenant
  that left the backlog last (the paper's Algorithm 2). Idling never buys a burst later.
- Preemption (the KV cache ran out): the victim is the most recently admitted running request of
  the tenant with the largest counter, so a flood's requests are recomputed before a light
  tenant's. Under FCFS it is the most recently admitted request, as before.
- Slots (`fair` only): each tenant with requests (running or waiting) is entitled to its
  weighted share of the `max_num_seqs` running slots, and to at least one. A waiting tenant that
  one more slot keeps within its share goes first (then the smallest counter, then the oldest
  request); and when every slot is taken it takes one from the tenant with the largest counter
  among those that one fewer leaves at or above their share (`slot_victim_index`: that tenant's
  latest request is preempted). Without it a flood that got the slots while nobody else waited
  keeps them, and a light tenant's first token waits for one of the flood's requests to finish.
  A swap leaves the taker within its share and the victim's tenant at or above its own, so it
  never turns back (two tenants never trade a slot); the victim's full blocks stay in the prefix
  cache, so its recomputation is mostly cache hits.
- First token alone (`fair` only): when the request next in line has never been scheduled and
  either none of its tenant's requests runs (while other tenants' do) or its tenant stays within
  its share of the slots with it while another tenant runs above its own, the step computes its
  prefill alone (`first_token_request`): its first token then waits for one short step rather
  than for a step that also carries every running decode, which on a compute-bound host costs
  several times the prefill. Never two such steps in a row, so a stream of newcomers at most
  halves the decodes' steps; a flood above its share never qualifies, nor do tenants that all
  hold their shares. The same request, arriving while a step runs, may instead cut into that
  step between two of its layers (scheduler.py, "Interjection").
- Prefill cap over share (`fair` only, `--max-prefill-tokens-over-share`): while a tenant below
  its share of the slots is present (has requests, or had some within the last
  `PRESENT_SECONDS`), the requests a tenant runs beyond its share (the latest admitted) get at
  most that many prompt tokens computed a step, all together (`prefill_cap_shares`); decodes are
  never held back, and a tenant within its share is never capped. A light
  tenant's request arrives into a step already running, and waits for it to end: without the
  cap, that step is often one where several of a flood's requests finished together and their
  successors' prompts all prefill at once, several times a decode step's length. "Present"
  reaches back in time because the step a request arrives into was planned before it came.
- `--max-running-seqs-per-tenant`: a tenant at its bound is skipped when admitting (its requests
  wait), under either policy; the others proceed.

Torch-free and a pure function of the scheduler's state (docs/architecture.md, rule 4).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvasir_engine.config import SchedulerConfig
from kvasir_engine.core.request import Request
from kvasir_engine.core.waiting_queue import WaitingQueue

# The paper's weights: an output token costs two prompt tokens (each is a forward of its own,
# where a prompt's tokens share one), about the ratio of the public per-token API prices.
W_PROMPT = 1.0
W_OUTPUT = 2.0
# A tenant with no requests still counts as present this long after its last one (the prefill
# cap over share): about the gap between an interactive user's requests.
PRESENT_SECONDS = 5.0
# Idle tenants' counters are dropped, once this many are kept, when no lift could need them.
_MAX_IDLE_COUNTERS = 1024


class FairShare:
    def __init__(self, config: SchedulerConfig) -> None:
        self.is_fair = config.policy == "fair"
        self.max_running_per_tenant = config.max_running_seqs_per_tenant
        self.max_num_seqs = config.max_num_seqs
        self.max_prefill_tokens_over_share = config.max_prefill_tokens_over_share
        self.waiting = WaitingQueue()
        self._tenant_to_weight = dict(config.tenant_weights)
        self._tenant_to_counter: dict[str, float] = {}
        self._tenant_to_num_running: Counter[str] = Counter()
        # The tenant that left the backlog last: a newcomer to an empty backlog gets its counter.
        self._last_left_tenant_id: str | None = None
        # Tenants present lately: the last time a step found them with requests.
        self._tenant_to_last_present: dict[str, float] = {}

    def counter(self, tenant_id: str) -> float:
        """Weighted service received so far (virtual tokens)."""
        return self._tenant_to_counter.get(tenant_id, 0.0)

    @property
    def num_counters(self) -> int:
        """Tenants whose counter is kept (those with requests, and idle ones above the floor)."""
        return len(self._tenant_to_counter)

    def num_running(self, tenant_id: str) -> int:
        return self._tenant_to_num_running[tenant_id]

    def add_waiting(self, request: Request, front: bool = False) -> None:
        """Queue a request (`front`: a preempted one); its tenant's first is lifted (no banking)."""
        tenant_id = request.tenant_id
        if self.waiting.add(request, front):
            others = [other for other in self.waiting.tenant_ids if other != tenant_id]
            self._tenant_to_counter[tenant_id] = max(self.counter(tenant_id),
                                                     self._lift_floor(others))

    def remove_waiting(self, request: Request) -> None:
        """Take a request out of the queue (admitted or aborted)."""
        if self.waiting.remove(request):  # its tenant left the backlog
            self._last_left_tenant_id = request.tenant_id
            self._forget_idle()

    def on_running(self, tenant_id: str, delta: int) -> None:
        """+1 when a request of `tenant_id` is admitted, -1 when one is preempted or finishes."""
        self._tenant_to_num_running[tenant_id] += delta
        if self._tenant_to_num_running[tenant_id] <= 0:
            del self._tenant_to_num_running[tenant_id]

    def charge_computed(self, request: Request, num_new_tokens: int) -> None:
        """A step computes `num_new_tokens` of `request` from its `num_computed_tokens` on."""
        # A decode's one token is the newest output fed back: paid for when it was sampled.
        num_prompt_side = (num_new_tokens if request.num_output_tokens == 0 else
                           min(num_new_tokens, request.num_tokens - 1 - request.num_computed_tokens))
        self._charge(request.tenant_id, W_PROMPT * num_prompt_side)

    def charge_output(self, request: Request, num_tokens: int) -> None:
        self._charge(request.tenant_id, W_OUTPUT * num_tokens)

    def next_waiting(self) -> Request | None:
        """The request to admit next; None when nobody waits or every waiting tenant is at its bound."""
        return self._next_waiting(None)

    def victim_index(self, running: list[Request]) -> int:
        """Index in `running` (admission order) of the request to preempt for KV blocks."""
        if not self.is_fair:
            return len(running) - 1
        return self._latest_of_most_served(running, range(len(running)))

    def excess_slot_index(self, running: list[Request]) -> int:
        """With more running than the slots (an interjected first token took one): the index in
        `running` of the request that gives a slot back, the latest of the most served among
        the tenants above their share of the slots (`victim_index` when none is)."""
        shares = self._slot_shares()
        num_running = self._tenant_to_num_running
        indices = [index for index, request in enumerate(running)
                   if num_running[request.tenant_id] > shares[request.tenant_id]]
        if not self.is_fair or not indices:
            return self.victim_index(running)
        return self._latest_of_most_served(running, indices)

    def slot_victim_index(self, running: list[Request]) -> int | None:
        """With every running slot taken: the index in `running` of the request whose slot the
        tenant next in line takes (see the module's "Slots"); None when nobody's should be."""
        if not self.is_fair or not running:
            return None
        shares = self._slot_shares()
        candidate = self._next_waiting(shares)
        num_running = self._tenant_to_num_running
        if candidate is None or num_running[candidate.tenant_id] + 1 > shares[candidate.tenant_id]:
            return None
        indices = [index for index, request in enumerate(running)
                   if request.tenant_id != candidate.tenant_id
                   and num_running[request.tenant_id] - 1 >= shares[request.tenant_id]]
        return self._latest_of_most_served(running, indices) if indices else None

    def first_token_request(self, running: list[Request]) -> Request | None:
        """The request whose prefill runs alone this step (see the module's "First token
        alone"), or None. The caller admits it and plans nothing else."""
        if not self.is_fair or not running:
            return None
        candidate = self._next_waiting(None)
        if candidate is None or candidate.first_scheduled_time is not None:
            return None
        num_running = self._tenant_to_num_running
        if num_running[candidate.tenant_id] == 0:
            return candidate
        # An interactive tenant that already runs a request, next to a flood above its share.
        shares = self._slot_shares()
        if (num_running[candidate.tenant_id] + 1 <= shares[candidate.tenant_id]
                and any(num_running[tenant_id] > share for tenant_id, share in shares.items())):
            return candidate
        return None

    def prefill_cap_shares(self, now: float) -> dict[str, float]:
        """The present tenants' shares of the slots when the prefill cap over share applies this
        step, else {} (see the module's "Prefill cap over share"): a request whose rank among its
        tenant's running ones (admission order, from 0) is at or above its tenant's share has its
        prompt tokens capped. Call once a step, with the step's time."""
        if not self.is_fair or not self.max_prefill_tokens_over_share:
            return {}
        last_present = self._tenant_to_last_present
        for tenant_id in set(self.waiting.tenant_ids) | set(self._tenant_to_num_running):
            last_present[tenant_id] = now
        for tenant_id, seen in list(last_present.items()):
            if now - seen > PRESENT_SECONDS:
                del last_present[tenant_id]
        if len(last_present) < 2:
            return {}
        shares = self._slot_shares(last_present)
        num_running = self._tenant_to_num_running
        if all(num_running[tenant_id] >= share for tenant_id, share in shares.items()):
            return {}
        return shares

    def _next_waiting(self, shares: dict[str, float] | None) -> Request | None:
        """`next_waiting`, given the slot shares when the caller has them already."""
        bound = self.max_running_per_tenant
        tenant_ids = [tenant_id for tenant_id in self.waiting.tenant_ids
                      if bound is None or self._tenant_to_num_running[tenant_id] < bound]
        if self.is_fair and len(tenant_ids) > 1:
            tenant_to_share = self._slot_shares() if shares is None else shares

            def key(tenant_id: str) -> tuple[bool, float]:
                num_after = self._tenant_to_num_running[tenant_id] + 1
                return num_after > tenant_to_share[tenant_id], self.counter(tenant_id)
            least = min(key(tenant_id) for tenant_id in tenant_ids)
            tenant_ids = [tenant_id for tenant_id in tenant_ids if key(tenant_id) == least]
        return self.waiting.first(tenant_ids)

    def _latest_of_most_served(self, running: list[Request], indices: Iterable[int]) -> int:
        """Of these indices in `running`: the latest admitted of the largest counter's tenant."""
        return max(indices, key=lambda index: (self.counter(running[index].tenant_id), index))

    def _slot_shares(self, tenant_ids: Iterable[str] | None = None) -> dict[str, float]:
        """Each of these tenants (default: those with requests): its weighted share of the
        running slots, at least one."""
        tenant_ids = (set(self.waiting.tenant_ids) | set(self._tenant_to_num_running)
                      if tenant_ids is None else set(tenant_ids))
        total_weight = sum(self._weight(tenant_id) for tenant_id in tenant_ids)
        return {tenant_id: max(1.0, self.max_num_seqs * self._weight(tenant_id) / total_weight)
                for tenant_id in tenant_ids}

    def _weight(self, tenant_id: str) -> float:
        return self._tenant_to_weight.get(tenant_id, 1.0)

    def _charge(self, tenant_id: str, virtual_tokens: float) -> None:
        self._tenant_to_counter[tenant_id] = (self.counter(tenant_id)
                                              + virtual_tokens / self._weight(tenant_id))

    def _lift_floor(self, backlogged_tenant_ids: Iterable[str]) -> float:
        """The smallest counter among these tenants, else the last one to leave the backlog's."""
        last_left = (0.0 if self._last_left_tenant_id is None
                     else self.counter(self._last_left_tenant_id))
        return min((self.counter(tenant_id) for tenant_id in backlogged_tenant_ids),
                   default=last_left)

    def _forget_idle(self) -> None:
        """Drop idle tenants' counters that every future lift would overwrite anyway.

        The lift floor never decreases (tenants enter the backlog at or above it, counters only
        grow, the last to leave was at or above it), so an idle counter at or below it would be
        lifted to at least the floor on return.
        """
        if len(self._tenant_to_counter) <= _MAX_IDLE_COUNTERS:
            return
        floor = self._lift_floor(self.waiting.tenant_ids)
        for tenant_id, counter in list(self._tenant_to_counter.items()):
            if (counter <= floor and tenant_id != self._last_left_tenant_id
                    and tenant_id not in self._tenant_to_num_running
                    and self.waiting.num_waiting(tenant_id) == 0):
                del self._tenant_to_counter[tenant_id]
