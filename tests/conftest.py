"""Fixtures shared by every test tree: a real S3 endpoint (moto's server) on 127.0.0.1, and kmock
with the API server's semantics."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from helm_support import helm  # noqa: F401  (a fixture for the chart tests of every tree)
from kmock_server import server_semantics


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session", autouse=True)
def kmock_like_a_server() -> Iterator[None]:
    """kmock filters selectors, creates on server-side apply and versions objects as the API
    server does (kmock_server.py), so no production code carries an emulator special case."""
    with pytest.MonkeyPatch.context() as monkeypatch, server_semantics(monkeypatch):
        yield


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
