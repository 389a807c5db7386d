"""The front end's tests share one tiny trained byte-level tokenizer (tests/engine/helpers.py)."""

from __future__ import annotations

import pytest
from helpers import write_tiny_tokenizer
from kvasir_engine.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(directory)
    return load_tokenizer(directory)
