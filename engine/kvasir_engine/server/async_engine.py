"""`AsyncEngine`: the server's side of the engine bridge; tenancy admission, drain and probes.

It holds an `EngineThread` (frontend/engine_thread.py), which alone runs `LLMEngine.step()` and
routes each step's outputs to the `RequestGroup` of the HTTP call that asked for them. Here, on
the event loop: the per-tenant admission ledger (429s), the count of open HTTP calls a drain
waits for, and the probes — liveness from the thread's progress, readiness from a
token-producing step, starting a tiny internal request when the engine is idle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.engine_thread import EngineThread
from kvasir_engine.frontend.engine_types import EngineDeadError, RequestSpec, SyncEngine
from kvasir_engine.frontend.metrics import EngineMetrics
from kvasir_engine.frontend.request_group import INTERNAL_PREFIX, Aborted, RequestGroup
from kvasir_engine.frontend.request_output import RequestOutput
from kvasir_engine.server.admission import AdmissionLedger, AdmissionLimits

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: SyncEngine, metrics: EngineMetrics | None = None, *,
                 limits: AdmissionLimits | None = None,
                 probe_token_ids: Sequence[int] = (1,),
                 on_death: Callable[[str], None] | None = None) -> None:
        self.engine_thread = EngineThread(engine, metrics, on_outputs=self._on_outputs,
                                          on_death=on_death)
        self.metrics = metrics
        # Sequences admitted and unfinished per tenant, checked against the queue bounds.
        self.ledger = AdmissionLedger(limits)
        self.probe_token_ids = list(probe_token_ids)
        self.num_active_groups = 0
        self._probe_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._probe_in_flight = False
        self._ids = itertools.count()
        self._groups_done = asyncio.Event()

    # -- lifecycle (event-loop side) ------------------------------------------------------------
    def start(self) -> None:
        self._groups_done = asyncio.Event()
        self.engine_thread.start()

    def stop(self) -> None:
        self.engine_thread.stop()

    def mark_dead(self, error: BaseException) -> None:
        """From any thread: see `EngineThread.mark_dead`."""
        self.engine_thread.mark_dead(error)

    def new_request_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}-{time.monotonic_ns() % 10**9}"

    # -- admission and abort (event-loop side) -------------------------------------------------
    async def add(self, specs: Sequence[RequestSpec]) -> RequestGroup:
        """Admits all specs (of one tenant) or none; raises QueueFullError, ValueError or
        EngineDeadError."""
        if not self.engine_thread.is_alive:
            raise EngineDeadError("the engine loop is not running")
        is_internal = specs[0].request_id.startswith(INTERNAL_PREFIX)
        if not is_internal:
            self.ledger.check(specs[0].tenant_id, len(specs))
            self.ledger.add(specs[0].tenant_id, [s.request_id for s in specs])
        group = RequestGroup([s.request_id for s in specs])
        done = self.engine_thread.submit(specs, group, time.monotonic())
        if not is_internal:
            self.num_active_groups += 1
            self._groups_done.clear()
        try:
            await asyncio.shield(done)
        except BaseException:
            self.release(group)
            raise
        return group

    def release(self, group: RequestGroup) -> None:
        """Forgets a group; aborts its unfinished requests (client gone, or finished early).

        After a cancelled admission the requests may still get added: the abort goes to the
        engine thread anyway, which applies it after the adds of the same batch.
        """
        if not group.released:
            group.released = True
            unfinished = group.unfinished_ids()
            self.engine_thread.forget(group.request_ids)
            for rid in group.request_ids:
                self.ledger.remove(rid)
                if self.metrics is not None:
                    self.metrics.forget_tenant_request(rid)
            if unfinished:
                self.engine_thread.abort(unfinished)
            if not group.request_ids[0].startswith(INTERNAL_PREFIX):
                self.num_active_groups -= 1
                if self.num_active_groups == 0:
                    self._groups_done.set()

    def abort_all(self) -> None:
        """Ends every open group with an abort (drain past its grace period)."""
        self.engine_thread.put_all(Aborted())

    async def wait_groups_done(self, timeout: float) -> bool:
        if self.num_active_groups == 0:
            return True
        try:
            await asyncio.wait_for(self._groups_done.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # -- probes (event-loop side) ----------------------------------------------------------------
    def health(self, stall_seconds: float) -> tuple[bool, str]:
        thread = self.engine_thread
        if not thread.is_alive:
            return False, f"engine loop is dead: {thread.error!r}"
        stalled_for = time.monotonic() - thread.last_progress
        if thread.has_work and stalled_for > stall_seconds:
            return False, (f"no engine step finished for {stalled_for:.1f}s "
                           f"(bound {stall_seconds:g}s) while requests are queued")
        return True, "ok"

    async def probe_ready(self, timeout: float, recent_seconds: float) -> tuple[bool, str]:
        """Whether the engine can generate (docs/architecture.md, "External contracts"), answered
        without queueing behind a step.

        A token-producing step that finished within `recent_seconds` already proves it: the
        answer is immediate, so a probe never waits for a long step under load. Otherwise the
        probe waits (up to `timeout`) for the next token-producing step, starting a real
        one-token generation when the engine is idle. A frozen engine therefore fails once its
        last progress is older than `recent_seconds`.
        """
        thread = self.engine_thread
        if not thread.is_alive:
            return False, "engine loop is not running"
        if time.monotonic() - thread.last_token_step_at <= recent_seconds:
            return True, "ok"
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (thread.token_step_count, waiter)
        self._probe_waiters.append(entry)
        try:
            if not thread.has_work and not self._probe_in_flight:
                self._start_probe_request()
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
            return True, "ok"
        except TimeoutError:
            return False, f"no token-producing engine step within {timeout:g}s"
        finally:
            if entry in self._probe_waiters:
                self._probe_waiters.remove(entry)

    def _start_probe_request(self) -> None:
        # A real one-token generation through the scheduler; its output is read by nobody.
        self._probe_in_flight = True
        spec = RequestSpec(self.new_request_id(f"{INTERNAL_PREFIX}probe"), self.probe_token_ids,
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))

        async def run() -> None:
            try:
                group = await self.add([spec])
                async for _ in group.outputs():
                    pass
                self.release(group)
            except Exception as e:  # noqa: BLE001 - the probe reports via its timeout
                logger.warning("readiness probe request failed: %s", e)
            finally:
                self._probe_in_flight = False

        asyncio.get_running_loop().create_task(run())

    # -- called by the engine thread's dispatch, on the event loop -----------------------------
    def _on_outputs(self, outputs: list[RequestOutput], token_step_count: int) -> None:
        for out in outputs:
            tenant_id = self.ledger.tenant_of.get(out.request_id)
            if tenant_id is None:
                continue  # internal (probe, warm-up), or released already
            if self.metrics is not None:
                self.metrics.observe_tenant_output(tenant_id, out)
            if out.is_finished:
                self.ledger.remove(out.request_id)
        for baseline, waiter in self._probe_waiters:
            if baseline < token_step_count and not waiter.done():
                waiter.set_result(None)

    def snapshot(self) -> dict[str, Any]:
        thread = self.engine_thread
        return {"step_count": thread.step_count, "token_step_count": thread.token_step_count,
                "num_active_groups": self.num_active_groups, "alive": thread.is_alive}
