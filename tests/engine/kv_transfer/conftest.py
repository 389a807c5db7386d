"""Shared here: one tiny random checkpoint; the server test harness made importable
(helpers.py comes from tests/engine)."""

import sys
from pathlib import Path

import pytest

_SERVER = str(Path(__file__).parents[1] / "server")
if _SERVER not in sys.path:
    sys.path.insert(0, _SERVER)

from helpers import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
