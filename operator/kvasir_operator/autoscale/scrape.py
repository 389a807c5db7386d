"""Reading each ready engine pod's `/metrics` over HTTP.

Two routes, one setting (`ScrapeSettings.route`, env `KVASIR_AUTOSCALER_SCRAPE`):
`direct` GETs http://<podIP>:<port>/metrics, which is what the operator does inside the cluster;
`proxy` goes through the API server's pod proxy (GET .../pods/<name>:<port>/proxy/metrics), for
an operator running outside the cluster (needs RBAC `get` on `pods/proxy`). `auto`, the default,
picks `direct` when KUBERNETES_SERVICE_HOST is set (in a pod) and `proxy` otherwise.

The port is the engine container's `http` containerPort from the pod spec (8000 in the rendered
Deployment), so a pod that publishes another port is still reached. A scrape that fails or times
out yields a `PodSample` with `error` set; it never raises and never blocks the other pods.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from .. import labels
from ..k8s import K8sClient
from .signals import PodSample, failed_sample, parse_metrics

ROUTES = ("auto", "direct", "proxy")


@dataclass(frozen=True)
class ScrapeSettings:
    route: str = "auto"
    timeout_seconds: float = 5.0  # per pod; a slower pod counts as a failed scrape

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise ValueError(f"KVASIR_AUTOSCALER_SCRAPE: must be one of {'|'.join(ROUTES)}, "
                             f"got {self.route!r}")
        if not self.timeout_seconds > 0:
            raise ValueError(f"KVASIR_AUTOSCALER_SCRAPE_TIMEOUT: must be > 0, "
                             f"got {self.timeout_seconds}")

    @property
    def is_direct(self) -> bool:
        if self.route == "auto":
            return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        return self.route == "direct"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ScrapeSettings:
        env = os.environ if env is None else env
        timeout_text = env.get("KVASIR_AUTOSCALER_SCRAPE_TIMEOUT", "5")
        try:
            timeout = float(timeout_text)
        except ValueError:
            raise ValueError(f"KVASIR_AUTOSCALER_SCRAPE_TIMEOUT: not a number: "
                             f"{timeout_text!r}") from None
        return cls(route=env.get("KVASIR_AUTOSCALER_SCRAPE", "auto"), timeout_seconds=timeout)


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
