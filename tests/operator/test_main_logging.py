"""The operator's log lines are printed once (issue 35: basicConfig beside kopf's handler
printed each twice)."""

from __future__ import annotations

import logging

import pytest
from kvasir_operator.main import configure_logging


def test_each_log_line_is_printed_once(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        root.handlers[:] = []
        configure_logging(verbose=False)
        configure_logging(verbose=False)  # configured again (a restart in one process): still one
        logging.getLogger("kvasir_operator.reconcile").info("reconciled ns/m")
        err = capsys.readouterr().err
        assert err.count("reconciled ns/m") == 1, err
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
