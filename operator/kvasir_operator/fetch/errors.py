"""Failures of a fetch, one class per exit code of the kvasir-fetch contract.

The initContainer's exit code is the operator's only structured signal of *why* a model could not
be fetched, so every failure the fetcher can name maps to exactly one code, and its message is one
line that also lands in the Kubernetes termination log (`kubectl describe pod` shows it).
"""

from __future__ import annotations

import os
import sys

EXIT_OK = 0
EXIT_UNEXPECTED = 1
TERMINATION_LOG = "/dev/termination-log"


class FetchError(Exception):
    """A failure with a known cause; `exit_code` is part of the CLI contract."""

    exit_code = EXIT_UNEXPECTED
    reason = "FetchFailed"


class UsageError(FetchError):
    exit_code = 2
    reason = "InvalidConfig"


class NotFound(FetchError):
    exit_code = 3
    reason = "NotFound"


class AccessDenied(FetchError):
    exit_code = 4
    reason = "AccessDenied"


class ChecksumMismatch(FetchError):
    exit_code = 5
    reason = "ChecksumMismatch"


class DiskFull(FetchError):
    exit_code = 6
    reason = "DiskFull"


class Stalled(FetchError):
    exit_code = 7
    reason = "Stalled"


class Unverified(FetchError):
    exit_code = 8
    reason = "UnverifiedSource"


def failure_line(error: BaseException) -> str:
    """The one line printed for a failure: reason, then the message, no traceback, no newlines."""
    if isinstance(error, FetchError):
        reason, text = error.reason, str(error)
    else:
        reason, text = "UnexpectedError", f"{type(error).__name__}: {error}"
    return f"kvasir-fetch: {reason}: {' '.join(text.split())}"


def exit_code_of(error: BaseException) -> int:
    return error.exit_code if isinstance(error, FetchError) else EXIT_UNEXPECTED


def report_failure(error: BaseException) -> int:
    """Print the failure line on stderr, copy it to the termination log, return the exit code."""
    line = failure_line(error)
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("KVASIR_FETCH_TERMINATION_LOG", TERMINATION_LOG)
    # Kubernetes creates the file; never create one ourselves (outside a pod that would litter /dev).
    if os.path.isfile(path) and os.access(path, os.W_OK):
        try:
            with open(path, "w", encoding="utf-8") as log:
                log.write(line + "\n")
        except OSError:
            pass
    return exit_code_of(error)
