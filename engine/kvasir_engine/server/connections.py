"""The HTTP server's connection limits: no socket is held open by a client that sends nothing.

uvicorn closes a kept-alive connection that stays idle after a response (`--keep-alive-timeout`,
its `timeout_keep_alive`), but a connection that never completes its request line and headers
(a slow-header client, or an idle socket that never sent a byte) has no timer at all: 200 such
sockets stayed open forever (issue 39). `HeaderDeadlineH11` adds one: the headers of each
request must be complete within `--request-header-timeout` of the connection opening (or of the
previous response ending); otherwise the server answers 408 and closes. The body has its own
deadline (body_limit.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvasir_engine.server.config import ServerConfig

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


class HeaderDeadlineH11(H11Protocol):
    header_timeout_s = 10.0  # set by `uvicorn_config` on a subclass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_header_timer()  # a request's headers are in: the body has its deadline

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()  # the next request's headers must come in time too

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None
                                           and not self.cycle.response_complete):
            return
        body = (b'{"error": {"message": "the request headers did not arrive within %gs '
                b'(--request-header-timeout)", "type": "invalid_request_error", '
                b'"param": null, "code": "request_timeout"}}' % self.header_timeout_s)
        self.transport.write(_TIMEOUT_RESPONSE % (len(body), body))
        self.transport.close()


def uvicorn_config(app: Any, server_config: ServerConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for this server: its address, and every connection limit."""
    protocol = type("HeaderDeadlineH11", (HeaderDeadlineH11,),
                    {"header_timeout_s": server_config.request_header_timeout_seconds})
    settings: dict[str, Any] = {
        "host": server_config.host, "port": server_config.port, "http": protocol,
        "timeout_keep_alive": server_config.keep_alive_timeout_seconds, "lifespan": "on",
    }
    settings.update(overrides)
    return uvicorn.Config(app, **settings)
