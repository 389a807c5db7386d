"""Request bodies: size-capped before anything parses them, read within a deadline, and every
refusal delivered as an answer rather than a reset connection.

A declared Content-Length above `--max-body-bytes` and a chunked body that grows past it both
get 413; a body that does not arrive within `--request-body-timeout` gets 408. The body is
buffered (it is JSON the route will parse whole anyway) and replayed to the app. This middleware
sits inside the API-key check (api.py), so nobody without a key gets a body buffered.

Why refusals drain: a server that answers and closes while the client is still uploading makes
the client's TCP stack see a reset, and the client reports a broken connection instead of the
413 it was sent. So before a refusal the rest of the body is read and thrown away, up to
`DRAIN_LIMIT_BYTES` and within the body deadline; past that the connection is closed anyway.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvasir_engine.server.errors import error_body

# The most bytes read and discarded to deliver a refusal (beyond it the connection just closes).
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
BODYLESS_METHODS = ("GET", "HEAD", "OPTIONS")


async def drain(receive: Receive, deadline: float, limit: int = DRAIN_LIMIT_BYTES) -> None:
    """Read and discard the rest of a request body (bounded in bytes and time)."""
    loop = asyncio.get_running_loop()
    drained = 0
    while drained <= limit:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), remaining)
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def send_refusal(send: Send, status: int, message: str, code: str,
                       extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            *(extra_headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def _too_large(self, receive: Receive, send: Send, deadline: float) -> None:
        await drain(receive, deadline)
        await send_refusal(send, 413, f"request body exceeds the limit of {self.limit} bytes "
                                      f"(--max-body-bytes)", "request_too_large",
                           [(b"connection", b"close")])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in BODYLESS_METHODS:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._too_large(receive, send, deadline)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                await send_refusal(send, 408, f"the request body did not arrive within "
                                              f"{self.body_timeout_s:g}s "
                                              f"(--request-body-timeout)", "request_timeout",
                                   [(b"connection", b"close")])
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large(receive, send, deadline)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
