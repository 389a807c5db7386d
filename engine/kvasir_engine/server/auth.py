"""Bearer API keys, checked in constant time before any route runs.

Keys come from `--api-key` (repeatable), `--api-key-file` and `KVASIR_API_KEYS`. Probes and
metrics stay open so that kubelet and Prometheus need no secret.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from kvasir_engine.server.errors import error_body

EXEMPT_PATHS = frozenset({"/health", "/ready", "/metrics"})


def is_valid_key(candidate: str, keys: tuple[bytes, ...]) -> bool:
    # Compare against every key without stopping early, so timing tells nothing about which matched.
    given = candidate.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    return matched


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        header = ""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                header = value.decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and is_valid_key(token.strip(), self.keys):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if not header
                   else "invalid API key")
        body = json.dumps(error_body(401, message, code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
