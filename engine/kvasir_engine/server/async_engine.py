"""`AsyncEngine`: runs `LLMEngine.step()` in its own thread and feeds asyncio per-request queues.

The event loop never blocks on the model. Only the engine thread touches the `LLMEngine`: the loop
hands it admissions and aborts through a locked inbox, and it hands back each step's outputs in one
`call_soon_threadsafe` callback. It sleeps on a condition while there is no work. A step counter,
the time of the last progress and a gate that tests can close (fault injection: a frozen step)
back the liveness and readiness probes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvasir_engine.core.request import SamplingParams
from kvasir_engine.core.scheduler import QueueFullError as SchedulerQueueFull
from kvasir_engine.metrics import EngineMetrics
from kvasir_engine.request_output import RequestOutput
from kvasir_engine.server.engine_types import (
    EngineDeadError,
    QueueFullError,
    RequestSpec,
    SyncEngine,
)
from kvasir_engine.server.request_group import INTERNAL_PREFIX, Aborted, RequestGroup

logger = logging.getLogger(__name__)


@dataclass
class _Admission:
    specs: Sequence[RequestSpec]
    group: RequestGroup
    arrival_time: float
    done: asyncio.Future[None] = field(repr=False)



class AsyncEngine:
    def __init__(self, engine: SyncEngine, metrics: EngineMetrics | None = None, *,
                 max_queue_len: int | None = None, probe_token_ids: Sequence[int] = (1,)) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        self.probe_token_ids = list(probe_token_ids)
        # Fault injection: tests clear it to freeze the engine before its next step.
        self.step_gate = threading.Event()
        self.step_gate.set()
        self.step_count = 0
        self.token_step_count = 0
        self.last_progress = time.monotonic()
        self.num_active_groups = 0
        self._cond = threading.Condition()
        self._inbox_adds: list[_Admission] = []
        self._inbox_aborts: list[str] = []
        self._stopping = False
        self._idle = True
        self._num_engine_requests = 0
        self._num_waiting = 0
        self._error: BaseException | None = None
        self._sinks: dict[str, RequestGroup] = {}
        # Engine thread only: ids added to the engine and not yet finished or aborted.
        self._live_ids: set[str] = set()
        # Engine thread only: the last stats predate an abort or a finish.
        self._stats_stale = False
        self._probe_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._probe_in_flight = False
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._groups_done = asyncio.Event()

    # -- lifecycle (event-loop side) ------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._groups_done = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="kvasir-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self.step_gate.set()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def mark_dead(self, error: BaseException) -> None:
        """From any thread: the engine cannot go on (a dead tensor-parallel rank). Probes fail,
        new requests are refused and open streams end with the error at once."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, error)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the scheduler after the last step."""
        return self._num_waiting

    @property
    def has_work(self) -> bool:
        return bool(self._inbox_adds or self._inbox_aborts or self._num_engine_requests)

    def new_request_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}-{time.monotonic_ns() % 10**9}"

    # -- admission and abort (event-loop side) -------------------------------------------------
    async def add(self, specs: Sequence[RequestSpec], group: RequestGroup | None = None
                  ) -> RequestGroup:
        """Admits all specs or none; raises QueueFullError, ValueError or EngineDeadError."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        is_internal = specs[0].request_id.startswith(INTERNAL_PREFIX)
        if (not is_internal and self.max_queue_len is not None
                and self._num_waiting + self._num_pending() + len(specs) > self.max_queue_len):
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests)")
        assert self._loop is not None
        group = group or RequestGroup([s.request_id for s in specs])
        admission = _Admission(specs, group, time.monotonic(), self._loop.create_future())
        with self._cond:
            if self._idle:
                self.last_progress = time.monotonic()
            self._inbox_adds.append(admission)
            self._cond.notify()
        for spec in specs:
            self._sinks[spec.request_id] = group
        if not is_internal:
            self.num_active_groups += 1
            self._groups_done.clear()
        try:
            await asyncio.shield(admission.done)
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
            for rid in group.request_ids:
                self._sinks.pop(rid, None)
            if unfinished:
                self.abort(unfinished)
            if not group.request_ids[0].startswith(INTERNAL_PREFIX):
                self.num_active_groups -= 1
                if self.num_active_groups == 0:
                    self._groups_done.set()

    def abort(self, request_ids: list[str]) -> None:
        with self._cond:
            self._inbox_aborts.extend(request_ids)
            self._cond.notify()

    def abort_all(self) -> None:
        """Ends every open group with an abort (drain past its grace period)."""
        for group in {id(g): g for g in self._sinks.values()}.values():
            group.put(Aborted())

    async def wait_groups_done(self, timeout: float) -> bool:
        if self.num_active_groups == 0:
            return True
        try:
            await asyncio.wait_for(self._groups_done.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _num_pending(self) -> int:
        return sum(len(a.specs) for a in self._inbox_adds)

    # -- probes (event-loop side) ----------------------------------------------------------------
    def health(self, stall_seconds: float) -> tuple[bool, str]:
        if not self.is_alive:
            return False, f"engine loop is dead: {self._error!r}"
        stalled_for = time.monotonic() - self.last_progress
        if self.has_work and stalled_for > stall_seconds:
            return False, (f"no engine step finished for {stalled_for:.1f}s "
                           f"(bound {stall_seconds:g}s) while requests are queued")
        return True, "ok"

    async def probe_ready(self, timeout: float) -> tuple[bool, str]:
        """True once a token-producing step finishes after this call began (see DESIGN.md)."""
        if not self.is_alive:
            return False, "engine loop is not running"
        assert self._loop is not None
        waiter: asyncio.Future[None] = self._loop.create_future()
        entry = (self.token_step_count, waiter)
        self._probe_waiters.append(entry)
        try:
            if not self.has_work and not self._probe_in_flight:
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

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox_adds or self._inbox_aborts or self._stats_stale
                               or self._num_engine_requests or self._stopping):
                        self._idle = True
                        self._cond.wait()
                    if self._stopping:
                        return
                    if self._idle:
                        self._idle = False
                        self.last_progress = time.monotonic()
                    adds, self._inbox_adds = self._inbox_adds, []
                    aborts, self._inbox_aborts = self._inbox_aborts, []
                for admission in adds:
                    self._admit(admission)
                # After the adds: an abort may name a request admitted in this same batch.
                live_aborts = [rid for rid in aborts if rid in self._live_ids]
                if live_aborts:
                    self.engine.abort_request(live_aborts)
                    self._live_ids.difference_update(live_aborts)
                if aborts:
                    self._stats_stale = True
                self._num_engine_requests = int(self.engine.has_unfinished_requests())
                if not self._num_engine_requests and not self._stats_stale:
                    continue
                self.step_gate.wait()
                # With nothing left this is an empty step (no forward pass): it refreshes the
                # stats after aborts and stop strings, so the gauges show what is really held.
                self._stats_stale = bool(self._num_engine_requests)
                self._step()
        except BaseException as e:  # noqa: BLE001 - recorded, reported by /health, streams fail
            logger.exception("engine loop died")
            self._error = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, e)

    def _admit(self, admission: _Admission) -> None:
        added: list[str] = []
        result: BaseException | None = None
        try:
            for spec in admission.specs:
                self.engine.add_request(spec.request_id, spec.prompt_token_ids, spec.params,
                                        arrival_time=admission.arrival_time)
                added.append(spec.request_id)
                self._live_ids.add(spec.request_id)
        except Exception as e:  # noqa: BLE001 - handed to the caller as its refusal
            result = QueueFullError(str(e)) if isinstance(e, SchedulerQueueFull) else e
            if added:
                self.engine.abort_request(added)
                self._live_ids.difference_update(added)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._settle, admission.done, result)

    @staticmethod
    def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _step(self) -> None:
        start = time.monotonic()
        outputs = self.engine.step()
        now = time.monotonic()
        self.step_count += 1
        self.last_progress = now
        stats = self.engine.last_stats
        self._num_waiting = stats.num_waiting_reqs
        self._num_engine_requests = int(self.engine.has_unfinished_requests())
        produced = any(o.new_token_ids for o in outputs)
        self._live_ids.difference_update(o.request_id for o in outputs if o.is_finished)
        if produced:
            self.token_step_count += 1
        if self.metrics is not None:
            self.metrics.observe_step(stats, now - start)
            for out in outputs:
                if not out.request_id.startswith(INTERNAL_PREFIX):
                    self.metrics.observe_output(out, now)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, outputs, self.token_step_count)

    # -- back on the event loop ----------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput], token_step_count: int) -> None:
        for out in outputs:
            group = self._sinks.get(out.request_id)
            if group is not None:
                group.put(out)
        for baseline, waiter in self._probe_waiters:
            if baseline < token_step_count and not waiter.done():
                waiter.set_result(None)

    def _fail_all(self, error: BaseException) -> None:
        for group in {id(g): g for g in self._sinks.values()}.values():
            group.put(EngineDeadError(f"the engine loop died: {error!r}"))

    def snapshot(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "token_step_count": self.token_step_count,
                "num_active_groups": self.num_active_groups, "alive": self.is_alive}
