"""OpenAI's error body and the exception handlers that produce it.

Every refusal the server makes leaves through `APIError`, so clients (the official `openai`
package included) see `{"error": {"message", "type", "param", "code"}}` with the status that
docs/architecture.md ("External contracts") fixes. Pydantic validation errors become 400s naming the offending parameter; nothing a client
sends becomes a 500.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_STATUS_TO_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ClientGone(Exception):
    """The client disconnected before its non-streaming response was ready (its requests are
    aborted). Not an error of the server's: logged at INFO, never with a traceback."""


class APIError(Exception):
    """A refusal with an HTTP status, sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, dict[str, object]]:
    return {"error": {"message": message, "type": _STATUS_TO_TYPE.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=dict(headers or {}))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_of(loc: tuple[object, ...]) -> str | None:
    # loc looks like ("body", "stop", "list[constrained-str]", 0); OpenAI names "stop.0".
    parts = [str(p) for p in loc[1:] if isinstance(p, int)
             or (isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def _loc(error: dict[str, object]) -> tuple[object, ...]:
    loc = error.get("loc", ())
    return tuple(loc) if isinstance(loc, (tuple, list)) else ()


def _most_specific(errors: list[dict[str, object]]) -> dict[str, object]:
    # A union field fails once per member (loc[2] names the member): the member that came
    # closest (fewest errors) explains it, and within it the deepest location. So a list of
    # texts with one bad item is reported at that item, not as "prompt.0: not an integer".
    field = _loc(errors[0])[:2]
    same_field = [e for e in errors if _loc(e)[:2] == field]
    per_member = Counter(_loc(e)[2] if len(_loc(e)) > 2 else None for e in same_field)
    return min(same_field, key=lambda e: (per_member[_loc(e)[2] if len(_loc(e)) > 2 else None],
                                          -len(_loc(e))))


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = _most_specific([dict(e) for e in errors])
    loc = _loc(first)
    msg = str(first.get("msg", "invalid value"))
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return f"request body is not valid JSON: {msg}", None
    if kind == "value_error":
        # Our model validators raise "param: reason"; pydantic prefixes "Value error, ". A nested
        # model's validator names its own field: prefix the path to it ("messages.0.content").
        msg = msg.removeprefix("Value error, ")
        head, sep, reason = msg.partition(": ")
        if sep and " " not in head:
            outer = _param_of(loc)
            param = f"{outer}.{head}" if outer else head
            return f"{param}: {reason}", param
    where = _param_of(loc)
    if where is None:
        return f"request body: {msg}", None
    return f"{where}: {msg}", where


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                              headers=exc.headers)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(exc)
        return error_response(400, message, param=param, code="invalid_value")

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        logger.info("client disconnected before the response to %s %s was ready; %s",
                    request.method, request.url.path, exc)
        # Nobody reads it; 499 is what proxies (nginx) log for a client that closed first.
        return Response(status_code=499)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        return error_response(500, "internal server error")

    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
