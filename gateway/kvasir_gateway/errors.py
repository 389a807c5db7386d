"""OpenAI's error shape for every refusal the gateway itself makes."""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import JSONResponse
from starlette.types import Send

_STATUS_TO_TYPE = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 429: "rate_limit_error",
                   502: "upstream_error", 503: "service_unavailable", 504: "upstream_error"}


class GatewayError(Exception):
    """A refusal with an HTTP status, sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, dict[str, object]]:
    return {"error": {"message": message, "type": _STATUS_TO_TYPE.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(exc: GatewayError) -> JSONResponse:
    headers = dict(exc.headers)
    if exc.status == 401:
        headers.setdefault("www-authenticate", "Bearer")
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code),
                        status_code=exc.status, headers=headers)


async def send_error(send: Send, exc: GatewayError) -> None:
    """The same response written straight to ASGI (the proxy routes are raw ASGI)."""
    body = json.dumps(error_body(exc.status, exc.message, exc.param, exc.code)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
