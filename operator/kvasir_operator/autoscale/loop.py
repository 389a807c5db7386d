"""The builtin autoscaler's loop: one asyncio task per InferenceService in mode builtin, or with
a price (`spec.cost.perHour`: the loop then scrapes for `status.cost` only).

Not a `@kopf.daemon`: kopf puts a finalizer on every object that has a daemon or a timer (so it
can stop them before the object goes), and a finalizer wedges `kubectl delete` while the operator
is down. The operator's `ObjectLoops` (loops.py) starts this task on the object's first event
and cancels it when the object is deleted or no longer needs it; the loop also ends by itself
when the object is gone. It keeps the sample window and the history in a local variable, and
re-reads `spec.autoscaling.intervalSeconds` every tick, so an interval change needs no restart.
A failed tick is logged and retried at the next interval; it never stops autoscaling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import k8s
from ..spec import AutoscalingSpec, SpecError
from ..spec_defaults import AUTOSCALING_DEFAULTS
from ..spec_parse import parse_spec
from .actuator import AutoscalerState, tick
from .scrape import ScrapeSettings

log = logging.getLogger(__name__)


def loop_policy(isvc: Mapping[str, Any]) -> AutoscalingSpec | None:
    """The object's autoscaling policy when its pods are to be scraped (mode builtin, or a
    declared `spec.cost.perHour` for `status.cost`), read through the one spec parser; None
    otherwise, or when the spec does not parse (the reconcile reports that)."""
    meta = isvc.get("metadata") or {}
    try:
        spec = parse_spec(str(meta.get("name")), isvc.get("spec"))
    except SpecError:
        return None
    is_scraped = spec.autoscaling.mode == "builtin" or spec.cost.per_hour is not None
    return spec.autoscaling if is_scraped else None


async def run_autoscaler(client: k8s.K8sClient, namespace: str | None, name: str,
                         settings: ScrapeSettings,
                         on_decision: Callable[[str], None] | None = None) -> None:
    """Tick until cancelled, or until the object is gone; `on_decision(reason)` is told each
    decision (the operator's metrics)."""
    state = AutoscalerState()
    while True:
        interval = float(AUTOSCALING_DEFAULTS["intervalSeconds"])
        try:
            isvc = await client.get(k8s.INFERENCESERVICES, namespace, name)
            if isvc is None:
                return
            policy = loop_policy(isvc)
            if policy is not None:
                interval = float(policy.interval_seconds)
            state, decision = await tick(client, isvc, state, settings=settings,
                                         clock=time.time)
            if decision is not None and on_decision is not None:
                on_decision(decision.reason.value)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the next tick retries; one bad scrape or API hiccup is fine
            log.warning("%s/%s: autoscaler tick failed: %s", namespace, name, exc)
        await asyncio.sleep(interval)
