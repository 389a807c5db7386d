"""Fixtures shared by every test tree: a real S3 endpoint (moto's server) on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from helm_support import helm  # noqa: F401  (a fixture for the chart tests of every tree)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
