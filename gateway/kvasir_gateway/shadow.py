"""Measuring the router's errors: re-ask the reference pool, off the client's path, and compare.

A hard question routed to the small pool gets a mediocre answer and no error fires. So a
`shadow.fraction` of the requests an alias answered from any pool other than its reference
(`shadow.model`, by default the cascade's last) is sent again to the reference, in a background
task after the client has its answer, and the two answers are compared:

- exactly (JSON compared parsed) when the answer is structured (the alias checks a JSON schema
  or a regex) or greedy (`temperature: 0`), since those have one right answer;
- otherwise by `difflib.SequenceMatcher` ratio over words, agreeing at or above
  `shadow.similarity_threshold`.

`kvasir_gateway_shadow_comparisons_total{alias, rule, outcome}` counts agree / disagree: the
disagreement rate per alias and rule is disagree / (agree + disagree);
`kvasir_gateway_shadow_tenant_comparisons_total{alias, tenant, outcome}` the same per tenant
(the tenant label bounded by `--max-tenant-labels`, later tenants counted as "other"). At most
`shadow.max_concurrent` shadows of an alias run at once; one more is dropped and counted
(`kvasir_gateway_shadow_dropped_total{reason="over_bound"}`), so shadows never pile up behind a
slow reference pool. Shadows are not charged to the tenant's quota: they are the operator's
measurement.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
import random
from typing import Any

import aiohttp

from kvasir_gateway.aliases import Route
from kvasir_gateway.checks import answer_text
from kvasir_gateway.context import GatewayContext
from kvasir_gateway.errors import GatewayError
from kvasir_gateway.sse import json_object
from kvasir_gateway.upstream import open_upstream

log = logging.getLogger("kvasir_gateway.shadow")


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.split(), b.split(), autojunk=False).ratio()


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()


def compare(answer: str, reference: str, is_exact: bool, threshold: float) -> tuple[bool, float]:
    """(agree, similarity)."""
    if is_exact:
        agree = _parsed(answer) == _parsed(reference)
        return agree, 1.0 if agree else similarity(answer, reference)
    score = similarity(answer, reference)
    return score >= threshold, score


class ShadowSampler:
    """Made by app.py, which closes it; the proxy offers it every answer of an alias."""

    def __init__(self, ctx: GatewayContext, seed: int | None = None) -> None:
        self.ctx = ctx
        self.random = random.Random(seed)
        self.tasks: set[asyncio.Task[None]] = set()
        self.alias_to_running: dict[str, int] = {}

    def maybe_shadow(self, route: Route, answered_by: str, path: str, tenant: str,
                     body: dict[str, Any], prompt_tokens: int, answer: str) -> None:
        shadow = route.alias.shadow
        if shadow.fraction <= 0 or answered_by == shadow.model:
            return
        if self.random.random() >= shadow.fraction:
            return
        name = route.alias.name
        if self.alias_to_running.get(name, 0) >= shadow.max_concurrent:
            self.ctx.metrics.shadow_dropped.labels(name, "over_bound").inc()
            return
        self.alias_to_running[name] = self.alias_to_running.get(name, 0) + 1
        task = asyncio.get_running_loop().create_task(
            self._run(route, path, tenant, body, prompt_tokens, answer))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, route: Route, path: str, tenant: str, body: dict[str, Any],
                   prompt_tokens: int, answer: str) -> None:
        alias, m = route.alias, self.ctx.metrics
        shadow_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        shadow_body["model"] = alias.shadow.model
        try:
            async with open_upstream(self.ctx, path, tenant, shadow_body, prompt_tokens,
                                     is_shadow=True) as upstream:
                response = upstream.response
                data = await response.read()
            if response.status != 200:
                raise GatewayError(response.status, data[:200].decode("utf-8", "replace"))
            reference = answer_text(json_object(data))
        except (GatewayError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            m.shadow_dropped.labels(alias.name, "error").inc()
            log.info("shadow of alias %s to %s failed: %s", alias.name, alias.shadow.model,
                     getattr(exc, "message", None) or exc)
            return
        finally:
            self.alias_to_running[alias.name] -= 1
        is_exact = alias.checks.is_structured or body.get("temperature") == 0
        agree, score = compare(answer, reference, is_exact, alias.shadow.similarity_threshold)
        outcome = "agree" if agree else "disagree"
        m.shadow_comparisons.labels(alias.name, route.rule, outcome).inc()
        m.shadow_tenant_comparisons.labels(alias.name, m.tenant_label(tenant), outcome).inc()
        m.shadow_similarity.labels(alias.name).observe(score)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
