"""The request body the gateway needs to understand: read within a size limit, checked, costed.

The gateway checks only what it uses (the JSON object itself, `model`, `stream`,
`stream_options`, `max_tokens`/`max_completion_tokens`, `n`, and that a prompt or messages are
there), naming the field in a 400, and refuses `kv_transfer_params` (its own to set, proxy.py); everything else is the engine's to validate, except numbers
that JSON cannot carry on: `NaN`, `Infinity`, a float literal beyond a double (Python's parser
would make it infinite) or an integer of more digits than Python converts, anywhere in the body,
are a 400 naming the field, since the body is sent on as JSON. The counts it reads are bounded
by an int32 (what the engine's counts hold), so a reservation always fits the quota store and
the metrics. The cost reserved at admission is the estimated prompt tokens (characters /
`chars_per_token`, or the count of token ids) plus `n` x max_tokens (`default_max_tokens` when
the request names none).

Parsing and the estimate are O(body): tens of milliseconds for a 4 MiB body on this host. A
body of `OFF_LOOP_BYTES` or more is parsed in a worker thread (the loop's default executor, a
bounded pool), so the other requests' events run between its steps; the JSON parser is C code
holding the GIL, so the loop still waits for its one longest call, never for the whole.
"""

from __future__ import annotations

import asyncio
import json
import math
import reprlib
import sys
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive

from kvasir_gateway.errors import GatewayError

MAX_COUNT = 2**31 - 1  # max_tokens, max_completion_tokens, n: an int32
OFF_LOOP_BYTES = 64 * 1024  # below this, parsing takes less than a thread hop (~0.1 ms)


@dataclass(frozen=True)
class ParsedRequest:
    body: dict[str, Any]
    prompt_tokens: int  # estimated: characters / chars_per_token, or the count of token ids


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


class _Unfit:
    """A number literal JSON cannot carry on, kept in place to find its field."""

    def __init__(self, text: str) -> None:
        self.text = text


def _reject_constant(text: str) -> float:
    raise ValueError(text)  # NaN, Infinity, -Infinity: not JSON


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _float_or_unfit(text: str) -> float | _Unfit:
    value = float(text)
    return value if math.isfinite(value) else _Unfit(text)


def _int_or_unfit(text: str) -> int | _Unfit:
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        return _Unfit(text)


def _unfit_number(raw: bytes) -> GatewayError:
    """The 400 naming the first unfit number's field (`temperature`, `prompt[3]`), found by
    parsing again with markers: only on this error path."""
    body = json.loads(raw, parse_constant=_Unfit, parse_float=_float_or_unfit,
                      parse_int=_int_or_unfit)
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Unfit):
            field = path or "body"
            return GatewayError(400, f"{field} must be a finite number (no NaN or Infinity, "
                                     f"within a double's range, at most "
                                     f"{sys.get_int_max_str_digits()} digits), got "
                                     f"{reprlib.repr(value.text)}", param=field,
                                code="invalid_value")
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return GatewayError(400, "request body holds a number JSON cannot carry",
                        code="invalid_value")


def _count(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise GatewayError(400, f"{name} must be an integer from 1 to {MAX_COUNT}, "
                                f"got {reprlib.repr(value)}", param=name, code="invalid_value")


def parse_request(raw: bytes, chat: bool, chars_per_token: float) -> ParsedRequest:
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}",
                           code="invalid_json") from None
    except ValueError:  # from a number: a hook above, or an integer of too many digits
        raise _unfit_number(raw) from None
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
        _count(body, name)
    if "kv_transfer_params" in body:  # names a host the decode engine would fetch blocks from
        raise GatewayError(400, "kv_transfer_params is the gateway's to set (between its "
                                "prefill and decode replicas), not a client's",
                           param="kv_transfer_params", code="invalid_value")
    field = "messages" if chat else "prompt"
    value = body.get(field)
    if chat and (not isinstance(value, list) or not value):
        raise GatewayError(400, "messages: a non-empty list is required", param="messages",
                           code="invalid_value")
    if not chat and not isinstance(value, (str, list)):
        raise GatewayError(400, "prompt: a string, a list of strings or token ids is required",
                           param="prompt", code="invalid_value")
    return ParsedRequest(body, prompt_tokens_estimate(body, chars_per_token))


async def parse_request_off_loop(raw: bytes, chat: bool,
                                 chars_per_token: float) -> ParsedRequest:
    if len(raw) < OFF_LOOP_BYTES:
        return parse_request(raw, chat, chars_per_token)
    return await asyncio.to_thread(parse_request, raw, chat, chars_per_token)


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


def reservation(request: ParsedRequest, default_max_tokens: int) -> int:
    body = request.body
    max_tokens: int = (body.get("max_completion_tokens") or body.get("max_tokens")
                       or default_max_tokens)
    n: int = body.get("n") or 1
    return request.prompt_tokens + max_tokens * n
