"""Shared fixtures for the autoscaler tests: sample windows and a tick-by-tick driver."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest_asyncio
from aiohttp import web
from kvasir_operator import labels
from kvasir_operator.autoscale.decision import Decision, decide
from kvasir_operator.autoscale.history import History
from kvasir_operator.autoscale.signals import PodSample, failed_sample
from kvasir_operator.autoscale.window import SampleWindow
from kvasir_operator.spec import AutoscalingSpec


@dataclass(frozen=True)
class Load:
    waiting: float = 0.0
    running: float = 0.0
    kv: float = 0.0


def window_of(now: float, pods: Mapping[str, Load | None], age: float = 0.0) -> SampleWindow:
    """One sample per pod taken `age` seconds ago; None stands for a failed scrape."""
    samples: list[PodSample] = []
    for name, load in pods.items():
        if load is None:
            samples.append(failed_sample(name, now - age, "connection refused"))
        else:
            samples.append(PodSample(name, now - age, num_waiting=load.waiting,
                                     num_running=load.running, kv_cache_usage=load.kv))
    return SampleWindow().record(samples, ready_pod_names=pods, now=now, horizon_seconds=1e9)


def spread(total: Load, num_pods: int) -> dict[str, Load | None]:
    """A pool total shared evenly by `num_pods` ready pods (KV capped at a full cache)."""
    if num_pods == 0:
        return {}
    return {f"p{i}": Load(total.waiting / num_pods, total.running / num_pods,
                          min(1.0, total.kv / num_pods)) for i in range(num_pods)}


def on_one_pod(total: Load, num_pods: int) -> dict[str, Load | None]:
    """The whole load queued on the first pod; the others idle (a skewed router)."""
    return {f"p{i}": total if i == 0 else Load() for i in range(num_pods)}


def long_history(now: float, policy: AutoscalingSpec) -> History:
    """A history that began long ago and holds no recent recommendation."""
    return History(started_at=now - 10 * policy.scale_down_delay_seconds - 1)


def run_ticks(policy: AutoscalingSpec, start_replicas: int, totals: Sequence[Load],
              *, start: float = 1_000_000.0, spread_waiting: bool = True) -> list[Decision]:
    """Drive decide() one interval at a time; new replicas are ready by the next tick."""
    share = spread if spread_waiting else on_one_pod
    replicas, history, now = start_replicas, long_history(start, policy), start
    decisions: list[Decision] = []
    for total in totals:
        decision = decide(policy, replicas, window_of(now, share(total, replicas)), 0,
                          history, now)
        history = history.record(now, decision.recommendation, policy.scale_down_delay_seconds)
        decisions.append(decision)
        replicas = decision.desired
        now += policy.interval_seconds
    return decisions


class FakeEngine:
    """A real HTTP server on 127.0.0.1 serving /metrics with values the test sets."""

    def __init__(self, model: str = "m") -> None:
        self.model = model
        self.waiting = 0.0
        self.running = 0.0
        self.kv = 0.0
        self.generation_tokens = 0.0  # the output-token counter (status.cost reads its rate)
        self.num_scrapes = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    def set(self, waiting: float = 0.0, running: float = 0.0, kv: float = 0.0) -> None:
        self.waiting, self.running, self.kv = waiting, running, kv

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.num_scrapes += 1
        label = f'{{model_name="{self.model}"}}'
        text = (f"# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{label} {self.waiting}\n"
                f"# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{label} {self.running}\n"
                f"# TYPE vllm:kv_cache_usage_perc gauge\n"
                f"vllm:kv_cache_usage_perc{label} {self.kv}\n"
                f"# TYPE vllm:generation_tokens counter\n"
                f"vllm:generation_tokens_total{label} {self.generation_tokens}\n")
        return web.Response(text=text, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def engine_pod(name: str, isvc: str, port: int, *, ready: bool = True,
               unschedulable: bool = False) -> dict[str, Any]:
    """A pod as the Deployment would run it, reachable at 127.0.0.1:<port>."""
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conditions = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                       "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns1",
                     "labels": labels.common_labels(isvc)},
        "spec": {"containers": [{"name": "engine", "ports": [
            {"name": "http", "containerPort": port}]}],
                 **({} if unschedulable else {"nodeName": "gpu-node-1"})},
        "status": {"phase": "Pending" if unschedulable else "Running",
                   "podIP": None if unschedulable else "127.0.0.1",
                   "conditions": conditions},
    }


@pytest_asyncio.fixture()
async def engines() -> AsyncIterator[list[FakeEngine]]:
    """Four fake engine pods' /metrics servers, started and stopped around the test."""
    fakes = [FakeEngine() for _ in range(4)]
    for fake in fakes:
        await fake.start()
    yield fakes
    for fake in fakes:
        await fake.stop()
