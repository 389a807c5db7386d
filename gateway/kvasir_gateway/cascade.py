"""A cascade's buffered attempts: what a cheaper pool is asked, how its whole answer is judged.

Every pool but the last is asked without streaming (the check needs the whole answer), with
logprobs when the logprob check needs them (`attempt_body`); the proxy reads the answer whole and
`judge` says which check it failed, if any. The answer that passes is sent to the client as it
asked (`send_buffered`): a JSON response, or, for a streaming client, a complete SSE stream built
from it (one chunk per choice, then the usage chunk if asked, then `[DONE]`). So a streaming
client waits for the small model's whole answer before its first token: the cascade's latency
cost. The last pool is streamed through as usual (nothing is checked after it).

Pure but for `send_buffered`'s two ASGI messages: the exchange with the engine and the tenant's
charge for every attempt, escalated ones included, are the proxy's (exchange.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.types import Send

from kvasir_gateway.aliases import Alias
from kvasir_gateway.checks import (
    CascadeChecks,
    client_wants_logprobs,
    failed_check,
    strip_logprobs,
    with_logprobs,
)
from kvasir_gateway.cost import CostModel
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.sse import completion_tokens, events_from_response, json_object, usage_tokens


@dataclass(frozen=True)
class Verdict:
    """One buffered attempt's outcome."""

    answer: dict[str, Any] | None  # None: no answer (no replica, an error status, not JSON)
    failed: str | None  # the check it failed ("error" without an answer); None: it passed
    used_tokens: int = 0  # the engine's usage (the prompt estimate when it reported none)
    num_completion_tokens: int = 0


NO_ANSWER = Verdict(None, "error")


def attempt_body(body: dict[str, Any], model: str, chat: bool,
                 checks: CascadeChecks) -> dict[str, Any]:
    """What `model` is asked: the client's body, not streamed, logprobs when checked."""
    upstream_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    upstream_body["model"] = model
    if checks.min_mean_logprob is not None:
        upstream_body = with_logprobs(upstream_body, chat)
    return upstream_body


def judge(status: int, data: bytes, checks: CascadeChecks, prompt_tokens: int) -> Verdict:
    """The whole answer an engine sent (`status`, `data`) against the alias's checks."""
    if status != 200:
        return NO_ANSWER
    try:
        answer = json_object(data)
    except ValueError:
        return NO_ANSWER
    used = usage_tokens(answer.get("usage"))
    return Verdict(answer, failed_check(checks, answer),
                   prompt_tokens if used is None else used, completion_tokens(answer) or 0)


async def send_buffered(send: Send, answer: dict[str, Any], chat: bool, body: dict[str, Any],
                        model: str, extra_headers: dict[str, str]) -> None:
    if not client_wants_logprobs(body):
        strip_logprobs(answer)
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        data = events_from_response(answer, chat, include_usage)
        content_type = b"text/event-stream; charset=utf-8"
    else:
        data = json.dumps(answer, separators=(",", ":")).encode()
        content_type = b"application/json"
    headers = [(b"content-type", content_type), (b"content-length", str(len(data)).encode()),
               (b"x-kvasir-model", model.encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra_headers.items()]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def account_cost(costs: CostModel, metrics: GatewayMetrics, alias: Alias,
                 attempts: list[tuple[str, int]]) -> None:
    """What the answer's output tokens cost (every attempt) against the reference pool
    (`shadow.model`, the cascade's last) producing the final answer's tokens. Unpriced pools:
    nothing counted."""
    reference = alias.shadow.model or (alias.cascade[-1] if alias.cascade else "")
    if not reference or not attempts:
        return
    reference_price = costs.cost_per_token(reference)
    prices = [costs.cost_per_token(model) for model, _ in attempts]
    if reference_price is None or any(p is None for p in prices):
        return
    actual = sum((p or 0.0) * tokens for p, (_, tokens) in zip(prices, attempts, strict=True))
    metrics.cascade_cost.labels(alias.name, "actual").inc(actual)
    metrics.cascade_cost.labels(alias.name, "always_large").inc(
        reference_price * attempts[-1][1])
