"""The builtin autoscaler's kopf handler: one daemon per InferenceService in mode builtin.

A daemon rather than a `@kopf.timer`: a timer's interval is fixed when it is decorated, while
`spec.autoscaling.intervalSeconds` is per object and may change; and the daemon keeps the sample
window and the history in a local variable for the life of the object. kopf starts it when the
object appears (or turns to mode builtin) and stops it when the object goes or leaves builtin.
A failed tick is logged and retried at the next interval; it never stops autoscaling.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from .. import k8s, labels
from .actuator import AutoscalerState, tick
from .scrape import ScrapeSettings

ISVC = (labels.GROUP, labels.VERSION, labels.PLURAL)
DEFAULT_INTERVAL_SECONDS = 15.0
log = logging.getLogger(__name__)


def is_builtin(spec: kopf.Spec, **_: Any) -> bool:
    autoscaling = spec.get("autoscaling") or {}
    return (autoscaling.get("mode") or "builtin") == "builtin"


def interval_of(isvc: dict[str, Any]) -> float:
    value = ((isvc.get("spec") or {}).get("autoscaling") or {}).get("intervalSeconds")
    return float(value) if isinstance(value, int | float) and value >= 1 else (
        DEFAULT_INTERVAL_SECONDS)


def _client(memo: kopf.Memo) -> k8s.K8sClient:
    # The operator's startup handler puts the client in memo; run alone, make our own.
    if not isinstance(getattr(memo, "k8s", None), k8s.K8sClient):
        memo.k8s = k8s.K8sClient.from_config()
    client: k8s.K8sClient = memo.k8s
    return client


@kopf.daemon(*ISVC, when=is_builtin, cancellation_timeout=10.0)
async def autoscale(name: str, namespace: str | None, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                    **_: Any) -> None:
    client = _client(memo)
    settings = ScrapeSettings.from_env()
    state = AutoscalerState()
    while not stopped:
        interval = DEFAULT_INTERVAL_SECONDS
        try:
            isvc = await client.get(k8s.INFERENCESERVICES, namespace, name)
            if isvc is None:
                return
            interval = interval_of(isvc)
            state, _decision = await tick(client, isvc, state, settings=settings,
                                          clock=time.time)
        except Exception as exc:  # the next tick retries; one bad scrape or API hiccup is fine
            log.warning("%s/%s: autoscaler tick failed: %s", namespace, name, exc)
        await stopped.wait(interval)
