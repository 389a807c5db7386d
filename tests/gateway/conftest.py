"""Fixtures of the gateway tests: one real redis-server for the session, emptied per test; and
the engine tests' helpers (`harness`, `helpers`) on the path for the tests that start real
engines."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from gateway_support import KEYS, RedisServer

_ENGINE_TESTS = Path(__file__).parents[1] / "engine"
for extra in (_ENGINE_TESTS, _ENGINE_TESTS / "server"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text("# tenants\n" + "".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    return path
