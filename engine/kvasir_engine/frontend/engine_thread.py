"""`EngineThread`: the one thread that drives `LLMEngine.step()`, bridged to an asyncio loop.

The event loop hands it admissions and aborts through a locked inbox (`submit`, `abort`); it
sleeps on a condition while there is no work, and hands back each step's outputs in one
`call_soon_threadsafe` callback, which puts every output on the `RequestGroup` (the sink) its
request was submitted with and then tells the owner (`on_outputs`). A step counter, the time of
the last progress and a gate that tests can close (fault injection: a frozen step) are what the
liveness and readiness probes read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvasir_engine.frontend.engine_types import EngineDeadError, RequestSpec, SyncEngine
from kvasir_engine.frontend.metrics import EngineMetrics
from kvasir_engine.frontend.request_group import INTERNAL_PREFIX, Aborted, RequestGroup
from kvasir_engine.frontend.request_output import RequestOutput

logger = logging.getLogger(__name__)

# Called on the event loop after each step's outputs reached their groups: (outputs, the
# number of token-producing steps so far).
OutputListener = Callable[[list[RequestOutput], int], None]


@dataclass
class _Admission:
    specs: Sequence[RequestSpec]
    arrival_time: float
    done: asyncio.Future[None] = field(repr=False)


class EngineThread:
    def __init__(self, engine: SyncEngine, metrics: EngineMetrics | None = None,
                 on_outputs: OutputListener | None = None,
                 on_death: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._on_outputs = on_outputs
        # Told (from the engine thread) when a step raised: the engine's own failure, since a
        # request's is isolated in the core (`RequestError`). The server exits on it.
        self._on_death = on_death
        # Fault injection: tests clear it to freeze the engine before its next step.
        self.step_gate = threading.Event()
        self.step_gate.set()
        self.step_count = 0
        self.token_step_count = 0
        self.last_progress = time.monotonic()
        # When the last step that produced tokens finished (monotonic); /ready answers from it.
        self.last_token_step_at = -math.inf
        self._cond = threading.Condition()
        self._inbox_adds: list[_Admission] = []
        self._inbox_aborts: list[str] = []
        self._stopping = False
        self._poked = False  # `poke`: one more step is wanted for work outside the queues
        self._idle = True
        self._num_engine_requests = 0
        self._num_waiting = 0
        self._error: BaseException | None = None
        # Event loop only: the group each submitted, not yet forgotten request reports to.
        self._sinks: dict[str, RequestGroup] = {}
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
    def error(self) -> BaseException | None:
        """Why the engine stopped, once it has."""
        return self._error

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the scheduler after the last step."""
        return self._num_waiting

    @property
    def has_work(self) -> bool:
        return bool(self._inbox_adds or self._inbox_aborts or self._num_engine_requests)

    @property
    def has_stale_stats(self) -> bool:
        """An abort or a finish happened after the last step's stats; one more (empty) step
        will refresh them."""
        return self._stats_stale

    # -- the inbox and the sinks (event-loop side) ---------------------------------------------
    def submit(self, specs: Sequence[RequestSpec], group: RequestGroup,
               arrival_time: float) -> asyncio.Future[None]:
        """Queue the specs for admission, all or none; their outputs go to `group`.

        The future resolves once the engine thread added them, or carries its refusal
        (`QueueFullError`, `ValueError`).
        """
        assert self._loop is not None, "start() first"
        done: asyncio.Future[None] = self._loop.create_future()
        for spec in specs:
            self._sinks[spec.request_id] = group
        with self._cond:
            if self._idle:
                self.last_progress = time.monotonic()
            self._inbox_adds.append(_Admission(specs, arrival_time, done))
            self._cond.notify()
        return done

    def poke(self) -> None:
        """From any thread: run one more (possibly empty) step soon, for work that is not a
        request (blocks a KV transfer gave back), even when the engine is idle."""
        with self._cond:
            self._poked = True
            self._cond.notify()

    def abort(self, request_ids: list[str]) -> None:
        with self._cond:
            self._inbox_aborts.extend(request_ids)
            self._cond.notify()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Stop routing these requests' outputs (their group is done with them)."""
        for request_id in request_ids:
            self._sinks.pop(request_id, None)

    def put_all(self, item: Aborted | BaseException) -> None:
        """Put one item on every open group (a drain's abort, the engine's death)."""
        for group in {id(g): g for g in self._sinks.values()}.values():
            group.put(item)

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox_adds or self._inbox_aborts or self._stats_stale
                               or self._num_engine_requests or self._stopping or self._poked):
                        self._idle = True
                        self._cond.wait()
                    if self._stopping:
                        return
                    if self._idle:
                        self._idle = False
                        self.last_progress = time.monotonic()
                    adds, self._inbox_adds = self._inbox_adds, []
                    aborts, self._inbox_aborts = self._inbox_aborts, []
                    if self._poked:
                        self._poked, self._stats_stale = False, True
                for admission in adds:
                    self._admit(admission)
                # After the adds: an abort may name a request admitted in this same batch.
                live_aborts = [rid for rid in aborts if rid in self._live_ids]
                if live_aborts:
                    self._count_aborts(self.engine.abort_request(live_aborts))
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
            if self._on_death is not None:
                self._on_death(f"the engine loop died: {e!r}")

    def _count_aborts(self, finals: list[RequestOutput]) -> None:
        """Aborted requests count as finished ("abort") in the metrics, as vLLM's do."""
        if self.metrics is not None:
            now = time.monotonic()
            for out in finals:
                if not out.request_id.startswith(INTERNAL_PREFIX):
                    self.metrics.observe_output(out, now)

    def _admit(self, admission: _Admission) -> None:
        added: list[str] = []
        result: BaseException | None = None
        try:
            for spec in admission.specs:
                transfer: dict[str, Any] = ({} if not spec.do_remote_decode and spec.kv_load is None
                                            else {"do_remote_decode": spec.do_remote_decode,
                                                  "kv_load": spec.kv_load})
                self.engine.add_request(spec.request_id, spec.prompt_token_ids, spec.params,
                                        cache_salt=spec.cache_salt,
                                        arrival_time=admission.arrival_time,
                                        tenant_id=spec.tenant_id, **transfer)
                added.append(spec.request_id)
                self._live_ids.add(spec.request_id)
        except Exception as e:  # noqa: BLE001 - handed to the caller as its refusal
            result = e
            if added:
                self.engine.abort_request(added)
                self._live_ids.difference_update(added)
        else:
            if self.metrics is not None:
                self.metrics.observe_admission([s for s in admission.specs if not
                                                s.request_id.startswith(INTERNAL_PREFIX)])
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
        """One step, its forward pass a decoder layer at a time: between two layers what
        arrived is admitted and may cut in (`_interject_arrivals`)."""
        start = time.monotonic()
        step = self.engine.begin_step()
        while step.advance():
            self._interject_arrivals()
        outputs = self.engine.end_step(step)
        now = time.monotonic()
        self.step_count += 1
        self.last_progress = now
        stats = self.engine.last_stats
        self._num_waiting = stats.num_waiting_reqs
        self._num_engine_requests = int(self.engine.has_unfinished_requests())
        if self.metrics is not None:
            self.metrics.observe_step(stats, now - start)
        self._deliver(outputs, now)

    def _interject_arrivals(self) -> None:
        """The step in flight waits between two decoder layers: admit what arrived since it
        began, and let their first tokens cut in while the scheduler lets them
        (`LLMEngine.interject`)."""
        if not self._inbox_adds:  # read without the lock: a hint
            return
        with self._cond:
            adds, self._inbox_adds = self._inbox_adds, []
        for admission in adds:
            self._admit(admission)
        while (outputs := self.engine.interject()) is not None:
            self._deliver(outputs, time.monotonic())

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        """A step's (or an interjection's) outputs to their groups, on the event loop."""
        self._live_ids.difference_update(o.request_id for o in outputs if o.is_finished)
        if any(o.new_token_ids for o in outputs):
            self.token_step_count += 1
            self.last_token_step_at = now
        if self.metrics is not None:
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
        if self._on_outputs is not None:
            self._on_outputs(outputs, token_step_count)

    def _fail_all(self, error: BaseException) -> None:
        self.put_all(EngineDeadError(f"the engine loop died: {error!r}"))
