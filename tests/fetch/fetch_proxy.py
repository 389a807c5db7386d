"""A small HTTP reverse proxy on 127.0.0.1 in front of moto, for server-side evidence.

It records every request (method, path, Range) so tests count GETs where S3 would, and it can
misbehave like a real network: delay ranged GETs (to kill a fetch half-way) or stop sending in
the middle of a body while keeping the connection open (a stall).
"""

from __future__ import annotations

import dataclasses
import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


@dataclasses.dataclass(frozen=True)
class Seen:
    method: str
    path: str  # path and query, as received
    range: str | None  # the Range header, when present

    @property
    def key(self) -> str:
        return urlsplit(self.path).path


class RecordingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.requests: list[Seen] = []
        self.lock = threading.Lock()
        self.range_delay_s = 0.0  # sleep before answering each ranged GET
        self.stall_after_bytes: int | None = None  # ranged GETs send this much body, then hang
        self.throttle_ranged = 0  # answer this many ranged GETs with 503 SlowDown, as S3 does
        self.closing = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                proxy.handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> RecordingProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()

    def ranged_gets(self) -> list[Seen]:
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and r.range]

    def gets_of(self, key_suffix: str) -> list[Seen]:
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and r.key.endswith(key_suffix)]

    def _take_throttle(self) -> bool:
        with self.lock:
            if self.throttle_ranged > 0:
                self.throttle_ranged -= 1
                return True
            return False

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        ranged = request.headers.get("Range")
        with self.lock:
            self.requests.append(Seen(request.command, request.path, ranged))
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        if ranged and self.range_delay_s:
            time.sleep(self.range_delay_s)
        if ranged and self._take_throttle():
            body503 = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            request.send_response(503, "Slow Down")
            request.send_header("Content-Type", "application/xml")
            request.send_header("Content-Length", str(len(body503)))
            request.end_headers()
            request.wfile.write(body503)
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() != "connection"}
            upstream.request(request.command, request.path, body=body, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
        finally:
            upstream.close()
        request.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                request.send_header(name, value)
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        if request.command == "HEAD":
            return
        if ranged and self.stall_after_bytes is not None and len(payload) > self.stall_after_bytes:
            request.wfile.write(payload[: self.stall_after_bytes])
            request.wfile.flush()
            self.closing.wait(120)  # keep the socket open and silent: a stalled transfer
            request.close_connection = True
            return
        request.wfile.write(payload)
