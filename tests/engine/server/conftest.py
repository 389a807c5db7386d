"""Shared fixtures: one tiny random checkpoint, one live server on it (prefix caching off)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from harness import LiveServer, live_server, tiny_config  # noqa: E402
from helpers import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    with live_server(tiny_config(tiny_model), health_stall_seconds=1.0,
                     ready_timeout_seconds=2.0, ready_recent_seconds=1.0, max_body_bytes=64 * 1024, max_n=4) as live:
        yield live
