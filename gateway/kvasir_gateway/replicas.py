"""The engine replicas the gateway knows, their state, and the probe loop that keeps it fresh.

Discovery (a static `--backend` list or the EndpointSlice watch) sets which URLs exist; every
`probe_interval` each replica is asked `/ready` (eligible or not), `/metrics`
(`vllm:num_requests_running` and `_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:generation_tokens_total` for its output tokens/s, cost.py), `/v1/models` (which models it
serves), `/version` (its KV-transfer role: `kv_role`, disaggregation.py; an engine that does not
say is a plain one) and, for precise routing, `/kvasir/prefix-cache` (the block hashes it holds,
precise.py). A replica becomes routable at its first passed probe and stops being so after
`failure_threshold` failed probes in a row (a loaded engine may miss one deadline); a failed
connection on a request ejects it for `eject_seconds`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvasir_gateway.errors import GatewayError
from kvasir_gateway.metrics import GatewayMetrics

log = logging.getLogger("kvasir_gateway.replicas")
# Output tokens/s are measured over this much scrape history: long enough to smooth batches
# out, short enough that a pool going idle shows within a minute.
RATE_WINDOW_SECONDS = 30.0
# The engine's --kv-transfer-config roles (docs/disaggregation.md), as its /version reports them.
KV_ROLES = frozenset({"kv_producer", "kv_consumer", "kv_both"})
PREFILL_ROLES = frozenset({"kv_producer", "kv_both"})  # may run a prompt for another to decode
DECODE_ROLES = frozenset({"kv_consumer", "kv_both"})  # may fetch a prompt's blocks and decode


class Stage(StrEnum):
    """Which replicas of a pool may take one upstream call (`ReplicaSet.candidates`)."""

    WHOLE = "whole"  # the whole request: any replica but a producer (a producer if none else)
    PREFILL = "prefill"  # the prompt only, its blocks kept for a consumer: PREFILL_ROLES
    DECODE = "decode"  # with a producer's kv_transfer_params: DECODE_ROLES


@dataclass
class Replica:
    url: str
    is_ready: bool = False
    models: tuple[dict[str, Any], ...] = ()  # the /v1/models entries it reported
    num_waiting: float = 0.0  # vllm:num_requests_waiting, last scrape
    num_running: float = 0.0  # vllm:num_requests_running, last scrape
    in_flight_at_scrape: int = 0  # num_in_flight when that scrape was answered
    kv_cache_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1), last scrape
    num_in_flight: int = 0  # requests this gateway has open on it now
    # Of those, the prompt tokens it is expected to compute before their first chunk (router.py)
    pending_prefill_tokens: float = 0.0
    ejected_until: float = 0.0
    model_ids: frozenset[str] = field(default_factory=frozenset)
    kv_role: str | None = None  # its /version's kv_role (KV_ROLES); None: a plain engine
    last_problem: str = ""  # why its last probe failed (logged once per distinct reason)
    num_probe_failures: int = 0  # consecutive failed probes
    # (monotonic seconds, vllm:generation_tokens_total) of the scrapes in the last RATE_WINDOW
    generation_samples: deque[tuple[float, float]] = field(default_factory=deque)
    # What its prefix cache holds (short block hashes), as its /kvasir/prefix-cache reported
    held_blocks: set[bytes] = field(default_factory=set)
    prefix_cache_instance: str | None = None  # the engine's view id; None: never reported
    prefix_cache_seq: int | None = None

    def record_generation_tokens(self, now: float, total: float) -> None:
        samples = self.generation_samples
        if samples and total < samples[-1][1]:  # the engine restarted: its counter too
            samples.clear()
        samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_SECONDS:
            samples.popleft()

    @property
    def output_tokens_per_second(self) -> float:
        """The generation rate over the last RATE_WINDOW_SECONDS of scrapes (0: unknown)."""
        samples = self.generation_samples
        if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
            return 0.0
        return (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])

    def is_routable(self, now: float) -> bool:
        return self.is_ready and now >= self.ejected_until

    @property
    def num_foreign(self) -> float:
        """Requests other gateways (or direct clients) had on it at the last scrape: the
        engine's running + waiting beyond ours. Ours are counted live, never twice (our
        waiting requests are in both the engine's queue and our in-flight count)."""
        return max(0.0, self.num_running + self.num_waiting - self.in_flight_at_scrape)

    @property
    def load(self) -> float:
        """What the bounded-load rule counts: our open requests plus everyone else's."""
        return self.num_in_flight + self.num_foreign


@dataclass(frozen=True)
class Scrape:
    """The load signals of one /metrics page, summed over its series."""

    num_waiting: float = 0.0
    num_running: float = 0.0
    kv_cache_usage: float = 0.0
    generation_tokens: float | None = None  # None: the page has no such counter


def parse_scrape(text: str) -> Scrape:
    """The signals of one /metrics page (the per-tenant kvasir: series are not these names)."""
    waiting = running = usage = 0.0
    generated: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_waiting":
                waiting += sample.value
            elif sample.name == "vllm:num_requests_running":
                running += sample.value
            elif sample.name == "vllm:kv_cache_usage_perc":
                usage = max(usage, sample.value)
            elif sample.name == "vllm:generation_tokens_total":
                generated = (generated or 0.0) + sample.value
    return Scrape(waiting, running, usage, generated)


def apply_prefix_report(replica: Replica, report: dict[str, Any]) -> None:
    """One /kvasir/prefix-cache answer: the whole set (`reset`) or the changes since our seq."""
    stored = {bytes.fromhex(h) for h in report.get("stored") or ()}
    if report.get("reset"):
        replica.held_blocks = stored
    else:
        replica.held_blocks -= {bytes.fromhex(h) for h in report.get("removed") or ()}
        replica.held_blocks |= stored
    replica.prefix_cache_instance = str(report["instance"])
    replica.prefix_cache_seq = int(report["seq"])


def parse_load(text: str) -> tuple[float, float]:
    """(num_requests_waiting, kv_cache_usage) summed over the series of one /metrics page."""
    scrape = parse_scrape(text)
    return scrape.num_waiting, scrape.kv_cache_usage


class ReplicaSet:
    def __init__(self, metrics: GatewayMetrics, *, headers: dict[str, str],
                 probe_interval: float, probe_timeout: float, eject_seconds: float,
                 failure_threshold: int = 3, poll_prefix_cache: bool = False) -> None:
        self.metrics = metrics
        self.poll_prefix_cache = poll_prefix_cache
        self.replicas: dict[str, Replica] = {}
        self.probe_interval = probe_interval
        self.eject_seconds = eject_seconds
        self.failure_threshold = failure_threshold
        self._headers, self._timeout = headers, probe_timeout
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def set_urls(self, urls: set[str]) -> None:
        """Discovery's current view: new URLs start unready until their first probe."""
        for url in set(self.replicas) - urls:
            del self.replicas[url]
            log.info("replica removed: %s", url)
        for url in urls - set(self.replicas):
            self.replicas[url] = Replica(url)
            log.info("replica added: %s", url)
        self._changed.set()

    def routable(self) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas.values() if r.is_routable(now)]

    def pool(self, model: str) -> list[Replica]:
        """The routable replicas serving `model`, whatever their role."""
        return [r for r in self.routable() if model in r.model_ids]

    def candidates(self, model: str, stage: Stage = Stage.WHOLE,
                   tried: frozenset[str] | set[str] = frozenset()) -> list[Replica]:
        """The routable replicas of `model`'s pool, not tried yet, that may take `stage`.
        A whole request stays off the producers while another replica can take it: they are
        sized for prompts, and their blocks are held for consumers."""
        pool = [r for r in self.pool(model) if r.url not in tried]
        if stage is Stage.PREFILL:
            return [r for r in pool if r.kv_role in PREFILL_ROLES]
        if stage is Stage.DECODE:
            return [r for r in pool if r.kv_role in DECODE_ROLES]
        return [r for r in pool if r.kv_role != "kv_producer"] or pool

    def eject(self, replica: Replica, why: str) -> None:
        replica.ejected_until = time.monotonic() + self.eject_seconds
        log.warning("replica %s ejected for %.1fs: %s", replica.url, self.eject_seconds, why)

    def no_replica_error(self, model: str) -> GatewayError:
        """Why no replica can take a request for `model`: not served (404), or none ready."""
        routable = self.routable()
        if routable and not any(model in r.model_ids for r in routable):
            served = sorted({m for r in routable for m in r.model_ids})
            return GatewayError(404, f"model {model!r} is not served here (served: "
                                     f"{', '.join(served)})", param="model",
                                code="model_not_found")
        return GatewayError(503, f"no ready replica for model {model!r} "
                                 f"({len(self.replicas)} known, none ready)",
                            code="no_ready_replica", headers={"retry-after": "1"})

    def models(self) -> list[dict[str, Any]]:
        """The union of the ready replicas' /v1/models entries, one per id."""
        seen: dict[str, dict[str, Any]] = {}
        for replica in self.routable():
            for entry in replica.models:
                seen.setdefault(str(entry.get("id")), entry)
        return [seen[k] for k in sorted(seen)]

    def open(self) -> None:
        """The probes' client, made in the running loop (the lifespan)."""
        self._session = aiohttp.ClientSession(
            headers=self._headers, timeout=aiohttp.ClientTimeout(total=self._timeout))

    async def _get(self, url: str) -> tuple[int, bytes]:
        assert self._session is not None, "ReplicaSet.open() first"
        async with self._session.get(url) as resp:
            return resp.status, await resp.read()

    async def probe(self, replica: Replica) -> None:
        base = replica.url.rstrip("/")
        try:
            status, _ = await self._get(f"{base}/ready")
            is_ready = status == 200
            if not is_ready and replica.last_problem != f"/ready {status}":
                replica.last_problem = f"/ready {status}"
                log.info("replica %s not ready: /ready answered %d", replica.url, status)
            if is_ready:
                status, data = await self._get(f"{base}/v1/models")
                if status != 200:
                    raise ValueError(f"/v1/models answered {status}: {data[:200]!r}")
                models = json.loads(data).get("data") or []
                replica.models = tuple(m for m in models if isinstance(m, dict))
                replica.model_ids = frozenset(str(m.get("id")) for m in replica.models)
                replica.kv_role = await self._kv_role(base)
                status, data = await self._get(f"{base}/metrics")
                if status == 200:
                    scrape = parse_scrape(data.decode("utf-8", "replace"))
                    replica.num_waiting, replica.num_running = (scrape.num_waiting,
                                                                scrape.num_running)
                    replica.kv_cache_usage = scrape.kv_cache_usage
                    replica.in_flight_at_scrape = replica.num_in_flight
                    if scrape.generation_tokens is not None:
                        replica.record_generation_tokens(time.monotonic(),
                                                         scrape.generation_tokens)
                if self.poll_prefix_cache:
                    await self._poll_prefix_cache(replica)
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            problem = str(exc) or type(exc).__name__
            if replica.is_ready or problem != replica.last_problem:  # once per new problem
                log.warning("replica %s failed its probe: %s", replica.url, problem)
            replica.last_problem = problem
            is_ready = False
        if is_ready:
            replica.num_probe_failures = 0
            if not replica.is_ready:
                replica.ejected_until, replica.last_problem = 0.0, ""
                log.info("replica ready: %s", replica.url)
            replica.is_ready = True
            return
        # A busy engine can miss one probe's deadline; like kubelet's failureThreshold, only
        # `failure_threshold` failures in a row take it out (a refused connection on a request
        # ejects it at once anyway).
        replica.num_probe_failures += 1
        if replica.num_probe_failures >= self.failure_threshold:
            replica.is_ready = False

    async def _kv_role(self, base: str) -> str | None:
        """The role its /version reports; an engine without the field (or the route) is plain."""
        status, data = await self._get(f"{base}/version")
        if status != 200:
            return None
        role = json.loads(data).get("kv_role")
        return role if role in KV_ROLES else None

    async def _poll_prefix_cache(self, replica: Replica) -> None:
        """The changes to its held blocks since the last poll (precise.py applies them); an
        engine without the route (404, 403) is routed by what we sent it only."""
        params = ""
        if replica.prefix_cache_instance is not None:
            params = (f"?instance={replica.prefix_cache_instance}"
                      f"&since={replica.prefix_cache_seq}")
        status, data = await self._get(f"{replica.url.rstrip('/')}/kvasir/prefix-cache{params}")
        if status != 200:
            if replica.prefix_cache_instance is not None or not replica.last_problem:
                log.warning("replica %s reports no prefix cache: /kvasir/prefix-cache "
                            "answered %d", replica.url, status)
                replica.last_problem = f"/kvasir/prefix-cache {status}"
            replica.held_blocks.clear()
            replica.prefix_cache_instance = replica.prefix_cache_seq = None
            return
        try:
            apply_prefix_report(replica, json.loads(data))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # not the engine's
            log.warning("replica %s sent a bad prefix-cache report: %s", replica.url, exc)
            replica.held_blocks.clear()
            replica.prefix_cache_instance = replica.prefix_cache_seq = None

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in list(self.replicas.values())))
        now = time.monotonic()
        states = {"ready": 0, "ejected": 0, "unready": 0}
        for r in self.replicas.values():
            states["ready" if r.is_routable(now) else "ejected" if r.is_ready else "unready"] += 1
        for state, count in states.items():
            self.metrics.replicas.labels(state).set(count)

    async def _loop(self) -> None:
        while True:
            await self.probe_all()
            self._changed.clear()
            try:  # a discovery change probes the new replicas at once
                await asyncio.wait_for(self._changed.wait(), self.probe_interval)
            except TimeoutError:
                pass

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
