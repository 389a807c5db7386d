"""The request body the gateway needs to understand: read within a size limit, checked, costed.

The gateway checks only what it uses (the JSON object itself, `model`, `stream`,
`stream_options`, `max_tokens`/`max_completion_tokens`, `n`, and that a prompt or messages are
there), naming the field in a 400; everything else is the engine's to validate. The cost
reserved at admission is the estimated prompt tokens (characters / `chars_per_token`, or the
count of token ids) plus `n` x max_tokens (`default_max_tokens` when the request names none).
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.types import Receive

from kvasir_gateway.errors import GatewayError


async def read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    declared = headers.get("content-length")
    too_large = GatewayError(413, f"request body exceeds the gateway's limit of {limit} bytes "
                                  f"(--max-body-bytes)", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise GatewayError(499, "client disconnected while sending its body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GatewayError(400, f"{name} must be a positive integer, got {value!r}",
                           param=name, code="invalid_value")
    return value


def parse_request(raw: bytes, chat: bool) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}",
                           code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "model: a non-empty string is required", param="model",
                           code="invalid_value")
    if not isinstance(body.get("stream", False), bool):
        raise GatewayError(400, "stream must be a boolean", param="stream", code="invalid_value")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError(400, "stream_options must be an object", param="stream_options",
                           code="invalid_value")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        _positive_int(body, name)
    field = "messages" if chat else "prompt"
    value = body.get(field)
    if chat and (not isinstance(value, list) or not value):
        raise GatewayError(400, "messages: a non-empty list is required", param="messages",
                           code="invalid_value")
    if not chat and not isinstance(value, (str, list)):
        raise GatewayError(400, "prompt: a string, a list of strings or token ids is required",
                           param="prompt", code="invalid_value")
    return body


def prompt_tokens_estimate(body: dict[str, Any], chars_per_token: float) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return sum(len(p) for p in prompt)
    if "messages" in body:
        text = json.dumps(body["messages"], ensure_ascii=False)
    else:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
    return math.ceil(len(text) / chars_per_token)


def reservation(body: dict[str, Any], chars_per_token: float, default_max_tokens: int) -> int:
    max_tokens = (body.get("max_completion_tokens") or body.get("max_tokens")
                  or default_max_tokens)
    n = body.get("n") or 1
    return prompt_tokens_estimate(body, chars_per_token) + int(max_tokens) * int(n)
