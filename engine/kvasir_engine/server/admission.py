"""Admission limits, counted in sequences (prompts x n), not HTTP requests.

Three bounds, each with the flag that sets it:

- `--max-request-sequences`: the fan-out of one request (prompts x n);
- `--max-queue-len`: sequences waiting beyond the running slots (`--max-num-seqs`). A sequence
  that will start as soon as the next step runs is not waiting, so an idle server with 4 running
  slots and a queue of 4 admits 8 sequences at once;
- `--max-waiting-seqs-per-tenant`: the same, for one tenant, beyond the running slots it may
  take (`--max-running-seqs-per-tenant` when the scheduler bounds it, else all). Unset, it is
  fair by default: where several tenants can be present (two or more API-key tenants, or a
  trusted gateway naming tenants) one tenant may hold at most half of what the server admits
  (running slots + queue), so no single key can fill the engine; the anonymous or single-tenant
  server keeps the whole queue.

`check_request` runs before admission and refuses with 400 (naming the flag) what could never be
admitted, however long the client retried; `AdmissionLedger.check` refuses with 429 what could
be admitted once others finish. The ledger counts, on the event loop, every sequence admitted and
not yet finished or released, per tenant; the server's internal probes are not in it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from kvasir_engine.config import SchedulerConfig
from kvasir_engine.core.limits import QueueFullError, queue_full

# --max-queue-len when not given: sequences waiting per running slot. A waiting sequence then
# waits about this many request durations at most, and a burst several times the batch fits.
DEFAULT_QUEUE_LEN_PER_RUNNING_SLOT = 4
# Unless --max-waiting-seqs-per-tenant says otherwise, the most of the admitted total (running
# slots + queue) one tenant may hold where several tenants can be present.
MULTI_TENANT_SHARE = 0.5


@dataclass(frozen=True)
class AdmissionLimits:
    max_num_seqs: int  # running slots (--max-num-seqs)
    max_queue_len: int  # waiting sequences beyond them
    max_request_sequences: int
    max_waiting_seqs_per_tenant: int | None = None
    # Running slots one tenant may take (--max-running-seqs-per-tenant, else max_num_seqs).
    max_running_seqs_per_tenant: int | None = None

    @property
    def tenant_running_slots(self) -> int:
        bound = self.max_running_seqs_per_tenant
        return self.max_num_seqs if bound is None else min(bound, self.max_num_seqs)

    def check_request(self, num_prompts: int, n: int) -> tuple[str, str] | None:
        """Why a request of num_prompts x n sequences can never be admitted, as (message,
        param); None when it can be (now or later)."""
        num_seqs = num_prompts * n
        shape = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        param = "prompt" if num_prompts > 1 else "n"
        if num_seqs > self.max_request_sequences:
            return (f"this request asks for {num_seqs} sequences ({shape}), more than the "
                    f"{self.max_request_sequences} one request may (--max-request-sequences)",
                    param)
        capacity = self.max_num_seqs + self.max_queue_len
        if num_seqs > capacity:
            return (f"this request asks for {num_seqs} sequences ({shape}) but at most "
                    f"{capacity} can ever be admitted ({self.max_num_seqs} running, "
                    f"--max-num-seqs, + {self.max_queue_len} waiting, --max-queue-len)", param)
        per_tenant = self.max_waiting_seqs_per_tenant
        if per_tenant is not None and num_seqs > self.tenant_running_slots + per_tenant:
            return (f"this request asks for {num_seqs} sequences ({shape}) but one tenant can "
                    f"hold at most {self.tenant_running_slots + per_tenant} "
                    f"({self.tenant_running_slots} running + {per_tenant} waiting, "
                    f"--max-waiting-seqs-per-tenant)", param)
        return None


def resolve_limits(scheduler: SchedulerConfig, *, max_request_sequences: int,
                   max_waiting_seqs_per_tenant: int | None,
                   is_multi_tenant: bool = False) -> AdmissionLimits:
    """The server's bounds: --max-queue-len as given, else DEFAULT_QUEUE_LEN_PER_RUNNING_SLOT
    waiting sequences per running slot (the offline engine keeps an unbounded queue); the
    per-tenant bound as given, else half the admitted total when several tenants can be
    present (`MULTI_TENANT_SHARE`)."""
    queue_len = scheduler.max_queue_len
    max_queue_len = (DEFAULT_QUEUE_LEN_PER_RUNNING_SLOT * scheduler.max_num_seqs
                     if queue_len is None else queue_len)
    limits = AdmissionLimits(
        max_num_seqs=scheduler.max_num_seqs, max_queue_len=max_queue_len,
        max_request_sequences=max_request_sequences,
        max_waiting_seqs_per_tenant=max_waiting_seqs_per_tenant,
        max_running_seqs_per_tenant=scheduler.max_running_seqs_per_tenant)
    if max_waiting_seqs_per_tenant is None and is_multi_tenant:
        share = int((limits.max_num_seqs + max_queue_len) * MULTI_TENANT_SHARE)
        limits = replace(limits, max_waiting_seqs_per_tenant=max(
            share - limits.tenant_running_slots, 0))
    return limits


class AdmissionLedger:
    """Sequences admitted and not yet finished, per tenant (event-loop side only)."""

    def __init__(self, limits: AdmissionLimits | None) -> None:
        self.limits = limits
        self.tenant_of: dict[str, str] = {}
        self.num_of_tenant: Counter[str] = Counter()

    @property
    def num_live(self) -> int:
        return len(self.tenant_of)

    def check(self, tenant_id: str, num_seqs: int) -> None:
        """Raises QueueFullError (429) when admitting num_seqs more would exceed a queue bound."""
        limits = self.limits
        if limits is None:
            return
        full = queue_full(self.num_live, num_seqs, limits.max_num_seqs, limits.max_queue_len)
        if full is not None:
            raise full
        per_tenant = limits.max_waiting_seqs_per_tenant
        held = self.num_of_tenant[tenant_id]
        if (per_tenant is not None
                and held + num_seqs - limits.tenant_running_slots > per_tenant):
            raise QueueFullError(
                f"tenant {tenant_id!r} holds {held} sequences already "
                f"({limits.tenant_running_slots} running + {per_tenant} waiting, "
                f"--max-waiting-seqs-per-tenant)")

    def add(self, tenant_id: str, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid not in self.tenant_of:
                self.tenant_of[rid] = tenant_id
                self.num_of_tenant[tenant_id] += 1

    def remove(self, request_id: str) -> None:
        tenant_id = self.tenant_of.pop(request_id, None)
        if tenant_id is not None:
            self.num_of_tenant[tenant_id] -= 1
            if not self.num_of_tenant[tenant_id]:
                del self.num_of_tenant[tenant_id]
