"""A cascade's buffered attempts: ask a cheaper pool, read its whole answer, check it.

Every pool but the last is asked without streaming (the check needs the whole answer), with
logprobs when the logprob check needs them; the answer that passes is sent to the client as it
asked: a JSON response, or, for a streaming client, a complete SSE stream built from it (one
chunk per choice, then the usage chunk if asked, then `[DONE]`). So a streaming client waits for
the small model's whole answer before its first token: the cascade's latency cost. The last pool
is streamed through as usual (nothing is checked after it).

What an attempt consumed is added to `Exchange.spent_tokens` as it goes (the prompt estimate as
soon as the engine answered, replaced by the engine's usage once read), so the proxy's single
settlement charges the tenant for every attempt, escalated ones included.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.types import Send

from kvasir_gateway.aliases import Alias
from kvasir_gateway.checks import (
    CascadeChecks,
    answer_text,
    client_wants_logprobs,
    failed_check,
    strip_logprobs,
    with_logprobs,
)
from kvasir_gateway.errors import GatewayError
from kvasir_gateway.sse import events_from_response, usage_tokens
from kvasir_gateway.upstream import json_object, open_upstream

if TYPE_CHECKING:
    from kvasir_gateway.app import Gateway
    from kvasir_gateway.proxy import Exchange


def completion_tokens(answer: dict[str, Any]) -> int | None:
    usage = answer.get("usage")
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) else None


async def attempt(g: Gateway, path: str, tenant: str, body: dict[str, Any], model: str,
                  chat: bool, checks: CascadeChecks,
                  exchange: Exchange) -> tuple[dict[str, Any] | None, str | None]:
    """(the answer, the check it failed or None). No answer (no replica, an error status):
    (None, "error"). A passing answer's usage is the exchange's; a failing one's is spent."""
    upstream_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    upstream_body["model"] = model
    if checks.min_mean_logprob is not None:
        upstream_body = with_logprobs(upstream_body, chat)
    provisional = exchange.prompt_tokens
    try:
        async with open_upstream(g, path, tenant, upstream_body,
                                 exchange.prompt_tokens) as upstream:
            exchange.spent_tokens += provisional  # the engine read the prompt
            response = upstream.response
            data = await response.read()
    except GatewayError:
        return None, "error"
    exchange.spent_tokens -= provisional
    if response.status != 200:
        return None, "error"
    try:
        answer = json_object(data)
    except ValueError:
        return None, "error"
    used = usage_tokens(answer.get("usage"))
    used = provisional if used is None else used
    tokens = completion_tokens(answer) or 0
    failed = failed_check(checks, answer)
    if failed is not None:
        exchange.spent_tokens += used
        exchange.attempts.append((model, tokens))
        return answer, failed
    exchange.used_tokens, exchange.final_completion_tokens = used, tokens
    return answer, None


async def send_buffered(send: Send, answer: dict[str, Any], chat: bool, body: dict[str, Any],
                        model: str, extra_headers: dict[str, str], exchange: Exchange) -> None:
    exchange.answered, exchange.status = True, 200
    exchange.answer = answer_text(answer)
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
    exchange.started = True
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def account_cost(g: Gateway, alias: Alias, attempts: list[tuple[str, int]]) -> None:
    """What the answer's output tokens cost (every attempt) against the reference pool
    (`shadow.model`, the cascade's last) producing the final answer's tokens. Unpriced pools:
    nothing counted."""
    reference = alias.shadow.model or (alias.cascade[-1] if alias.cascade else "")
    if not reference or not attempts:
        return
    reference_price = g.costs.cost_per_token(reference)
    prices = [g.costs.cost_per_token(model) for model, _ in attempts]
    if reference_price is None or any(p is None for p in prices):
        return
    actual = sum((p or 0.0) * tokens for p, (_, tokens) in zip(prices, attempts, strict=True))
    g.metrics.cascade_cost.labels(alias.name, "actual").inc(actual)
    g.metrics.cascade_cost.labels(alias.name, "always_large").inc(
        reference_price * attempts[-1][1])
