"""Reading each ready engine pod's `/metrics` over HTTP.

Two routes, one setting (`ScrapeSettings.route`, from `Settings.scrape_route`):
`direct` GETs http://<podIP>:<port>/metrics, which is what the operator does inside the cluster;
`proxy` goes through the API server's pod proxy (GET .../pods/<name>:<port>/proxy/metrics), for
an operator running outside the cluster (needs RBAC `get` on `pods/proxy`). `auto`, the default,
picks `direct` when the operator runs in a pod and `proxy` otherwise.

The port is the engine container's `http` containerPort from the pod spec (8000 in the rendered
Deployment), so a pod that publishes another port is still reached. A scrape that fails or times
out yields a `PodSample` with `error` set; it never raises and never blocks the other pods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from .. import labels
from ..k8s import K8sClient
from ..settings import SCRAPE_ROUTES, Settings
from .signals import PodSample, failed_sample, parse_metrics


@dataclass(frozen=True)
class ScrapeSettings:
    route: str = "auto"
    timeout_seconds: float = 5.0  # per pod; a slower pod counts as a failed scrape
    in_cluster: bool = False  # what "auto" decides by

    def __post_init__(self) -> None:
        if self.route not in SCRAPE_ROUTES:
            raise ValueError(f"scrape route: must be one of {'|'.join(SCRAPE_ROUTES)}, "
                             f"got {self.route!r}")
        if not self.timeout_seconds > 0:
            raise ValueError(f"scrape timeout: must be > 0, got {self.timeout_seconds}")

    @property
    def is_direct(self) -> bool:
        return self.in_cluster if self.route == "auto" else self.route == "direct"

    @classmethod
    def from_settings(cls, settings: Settings) -> ScrapeSettings:
        return cls(route=settings.scrape_route, timeout_seconds=settings.scrape_timeout_seconds,
                   in_cluster=settings.in_cluster)


def metrics_port(pod: Mapping[str, Any]) -> int:
    """The engine container's `http` port, else its first port, else 8000."""
    containers = (pod.get("spec") or {}).get("containers") or []
    engine = next((c for c in containers if c.get("name") == labels.ENGINE_CONTAINER),
                  containers[0] if containers else {})
    ports = engine.get("ports") or []
    port = next((p for p in ports if p.get("name") == labels.HTTP_PORT_NAME),
                ports[0] if ports else {})
    return int(port.get("containerPort") or labels.HTTP_PORT)


async def _get_direct(session: aiohttp.ClientSession, pod: Mapping[str, Any]) -> str:
    ip = str((pod.get("status") or {}).get("podIP") or "")
    if not ip:
        raise ValueError("pod has no status.podIP")
    host = f"[{ip}]" if ":" in ip else ip
    async with session.get(f"http://{host}:{metrics_port(pod)}/metrics") as resp:
        if resp.status != 200:
            raise ValueError(f"/metrics answered HTTP {resp.status}")
        return await resp.text()


async def scrape_pods(client: K8sClient, pods: Sequence[Mapping[str, Any]], *,
                      settings: ScrapeSettings, model_name: str | None,
                      clock: Callable[[], float]) -> list[PodSample]:
    """One sample per pod, scraped concurrently, each bounded by the settings' timeout."""
    timeout = aiohttp.ClientTimeout(total=settings.timeout_seconds)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(pod: Mapping[str, Any]) -> PodSample:
            meta = pod.get("metadata") or {}
            name = str(meta.get("name"))
            try:
                if settings.is_direct:
                    text = await _get_direct(session, pod)
                else:
                    text = await asyncio.wait_for(
                        client.proxy_get(str(meta.get("namespace")), name, metrics_port(pod),
                                         "/metrics"), settings.timeout_seconds)
            except Exception as exc:  # any failure (HTTP, timeout, proxy ApiError) = no sample
                return failed_sample(name, clock(), f"{type(exc).__name__}: {exc}")
            return parse_metrics(text, pod_name=name, timestamp=clock(), model_name=model_name)

        return list(await asyncio.gather(*(one(p) for p in pods)))
