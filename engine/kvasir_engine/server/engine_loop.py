"""`EngineLoop`: the thread that alone drives `LLMEngine.step()`, fed through a locked inbox.

The event loop hands it admissions and aborts through the inbox; it sleeps on a condition while
there is no work and hands back each step's outputs in one `call_soon_threadsafe` callback
(`_dispatch`, which `AsyncEngine` implements on the event-loop side). A step counter, the time of
the last progress and a gate that tests can close (fault injection: a frozen step) back the
liveness and readiness probes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvasir_engine.core.scheduler import QueueFullError as SchedulerQueueFull
from kvasir_engine.metrics import EngineMetrics
from kvasir_engine.request_output import RequestOutput
from kvasir_engine.server.engine_types import QueueFullError, RequestSpec, SyncEngine
from kvasir_engine.server.request_group import INTERNAL_PREFIX, RequestGroup

logger = logging.getLogger(__name__)


@dataclass
class Admission:
    specs: Sequence[RequestSpec]
    group: RequestGroup
    arrival_time: float
    done: asyncio.Future[None] = field(repr=False)


class EngineLoop:
    def __init__(self, engine: SyncEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        # Fault injection: tests clear it to freeze the engine before its next step.
        self.step_gate = threading.Event()
        self.step_gate.set()
        self.step_count = 0
        self.token_step_count = 0
        self.last_progress = time.monotonic()
        # When the last step that produced tokens finished (monotonic); /ready answers from it.
        self.last_token_step_at = -math.inf
        self._cond = threading.Condition()
        self._inbox_adds: list[Admission] = []
        self._inbox_aborts: list[str] = []
        self._stopping = False
        self._idle = True
        self._num_engine_requests = 0
        self._num_waiting = 0
        self._error: BaseException | None = None
        # Engine thread only: ids added to the engine and not yet finished or aborted.
        self._live_ids: set[str] = set()
        # Engine thread only: the last stats predate an abort or a finish.
        self._stats_stale = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle (event-loop side) ------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
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

    # -- the inbox (event-loop side) -------------------------------------------------------------
    def _submit(self, admission: Admission) -> None:
        with self._cond:
            if self._idle:
                self.last_progress = time.monotonic()
            self._inbox_adds.append(admission)
            self._cond.notify()

    def abort(self, request_ids: list[str]) -> None:
        with self._cond:
            self._inbox_aborts.extend(request_ids)
            self._cond.notify()

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

    def _admit(self, admission: Admission) -> None:
        added: list[str] = []
        result: BaseException | None = None
        try:
            for spec in admission.specs:
                self.engine.add_request(spec.request_id, spec.prompt_token_ids, spec.params,
                                        cache_salt=spec.cache_salt,
                                        arrival_time=admission.arrival_time,
                                        tenant_id=spec.tenant_id)
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
            self.last_token_step_at = now
        if self.metrics is not None:
            self.metrics.observe_step(stats, now - start)
            for out in outputs:
                if not out.request_id.startswith(INTERNAL_PREFIX):
                    self.metrics.observe_output(out, now)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, outputs, self.token_step_count)

    # -- called back on the event loop; the bridge routes them to its request groups ---------
    def _dispatch(self, outputs: list[RequestOutput], token_step_count: int) -> None:
        raise NotImplementedError

    def _fail_all(self, error: BaseException) -> None:
        raise NotImplementedError
