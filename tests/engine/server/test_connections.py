"""Connections a client holds open without finishing a request are closed, with an answer.

Raw sockets against a live server with short limits: an idle socket that never sends a byte, a
request whose headers stall, a body that stalls, and an idle kept-alive connection are each
closed (the first three after a 408 naming the flag); an upload without a key gets its 401 (the
key is checked from the headers, the body drained and discarded) rather than a reset.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import API_KEY, LiveServer, live_server, tiny_config

LIMIT_S = 1.0
# How long a test waits for the server to act on a 1 s limit (a loaded CI host is slow).
WAIT_S = 15.0


@pytest.fixture(scope="module")
def strict_server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(tiny_config(tiny_model), request_header_timeout_seconds=LIMIT_S,
                     request_body_timeout_seconds=LIMIT_S,
                     keep_alive_timeout_seconds=1) as live:
        yield live


def _connect(server: LiveServer) -> socket.socket:
    port = int(server.base_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    start = time.monotonic()
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def _status_and_error(data: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


STALLED_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
STALLED_BODY = (STALLED_HEAD + b"content-type: application/json\r\ncontent-length: 100\r\n"
                b"authorization: Bearer " + API_KEY.encode() + b"\r\n\r\n{\"prompt\": ")


@pytest.mark.parametrize(("sent", "flag"), [(b"", "--request-header-timeout"),
                                            (STALLED_HEAD, "--request-header-timeout"),
                                            (STALLED_BODY, "--request-body-timeout")],
                         ids=["idle-socket", "stalled-headers", "stalled-body"])
def test_a_stalled_request_is_closed_with_408(strict_server: LiveServer, sent: bytes,
                                              flag: str) -> None:
    with _connect(strict_server) as sock:
        sock.sendall(sent)
        data, _ = _read_until_closed(sock)
    status, error = _status_and_error(data)
    assert status == 408 and error["code"] == "request_timeout", data
    assert flag in str(error["message"]), data


def test_an_idle_kept_alive_connection_is_closed(strict_server: LiveServer) -> None:
    with _connect(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        data, _ = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200"), data


def test_an_upload_without_a_key_gets_its_401(strict_server: LiveServer) -> None:
    content = b'{"prompt": "' + b"x" * (6 * 1024 * 1024) + b'"}'
    resp = httpx.post(strict_server.base_url + "/v1/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert resp.status_code == 401, resp.text[:200]
    assert resp.json()["error"]["code"] == "invalid_api_key"


def test_a_prompt_request_still_works(strict_server: LiveServer) -> None:
    resp = strict_server.post("/v1/completions",
                              json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
