"""The types the HTTP layer and the engine bridge exchange: refusals, the engine protocol, specs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvasir_engine.core.outputs import SchedulerStats
from kvasir_engine.core.request import ANONYMOUS_TENANT, SamplingParams
from kvasir_engine.request_output import RequestOutput


class QueueFullError(Exception):
    """A queue bound (--max-queue-len, --max-waiting-seqs-per-tenant) is reached; admitting
    is possible once others finish (HTTP 429 with Retry-After)."""


class EngineDeadError(Exception):
    """The engine thread has stopped (HTTP 503)."""


class SyncEngine(Protocol):
    """What the bridge needs of `LLMEngine` (see llm_engine.py's contract)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    tenant_id: str = ANONYMOUS_TENANT) -> None: ...
    def abort_request(self, request_ids: list[str]) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    @property
    def last_stats(self) -> SchedulerStats: ...


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant_id: str = ANONYMOUS_TENANT
    # The block-hash salt, derived server-side from the tenant and the request's cache_salt.
    cache_salt: str | None = None
