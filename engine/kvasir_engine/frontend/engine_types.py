"""The types an asyncio caller and the engine thread exchange: the engine protocol, specs, death.

A refusal because a queue is full is the core's `QueueFullError` (core/scheduler.py), whoever
counted the bound; a request that can never fit is a `ValueError` naming its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvasir_engine.core.engine_core import StepInFlight
from kvasir_engine.core.outputs import SchedulerStats
from kvasir_engine.core.request import ANONYMOUS_TENANT, KVLoadSpec, SamplingParams
from kvasir_engine.frontend.request_output import RequestOutput


class EngineDeadError(Exception):
    """The engine thread has stopped (HTTP 503)."""


class SyncEngine(Protocol):
    """What the engine thread needs of `LLMEngine` (see llm_engine.py)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    tenant_id: str = ANONYMOUS_TENANT, do_remote_decode: bool = False,
                    kv_load: KVLoadSpec | None = None) -> None: ...
    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]: ...
    def begin_step(self) -> StepInFlight: ...
    def end_step(self, step: StepInFlight) -> list[RequestOutput]: ...
    def interject(self) -> list[RequestOutput] | None: ...
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
    # The requests of one prompt's n choices share it (vLLM's parent request, for its n and
    # max-generation-tokens histograms); None: a request of its own.
    parent_id: str | None = None
    # Disaggregated prefill (kv_transfer/): a producer's request keeps its blocks for its
    # consumer; a consumer's arrives with its prompt's K/V staged.
    do_remote_decode: bool = False
    kv_load: KVLoadSpec | None = None
