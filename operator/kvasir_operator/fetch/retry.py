"""Which failures are worth another attempt, and how long to wait before it.

Throttling, 5xx and broken or silent connections are transient on S3 and S3-compatible stores, so
they are retried with capped exponential backoff and full jitter (AWS's recommendation: it keeps
many pods of one rollout from retrying in lockstep). Everything else is translated once into the
`FetchError` that carries the contract's exit code.
"""

from __future__ import annotations

import errno
import random

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from urllib3.exceptions import HTTPError as Urllib3Error

from .errors import AccessDenied, ChecksumMismatch, DiskFull, FetchError, NotFound, Stalled

BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 20.0

_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "NotFound", "404"}
_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "AccountProblem",
    "403",
    "InvalidClientTokenId",
}
_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "502",
    "504",
}
_TIMEOUTS = (ReadTimeoutError, ConnectTimeoutError, TimeoutError)
_BROKEN = (
    ConnectionClosedError,
    EndpointConnectionError,
    IncompleteReadError,
    ResponseStreamingError,
    ConnectionError,
    Urllib3Error,
)


def backoff_seconds(attempt: int, rng: random.Random) -> float:
    """Full-jitter exponential backoff for retry number `attempt` (1-based)."""
    return rng.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1)))


def client_error_code(exc: ClientError) -> str:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or str(status or "")


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, (*_TIMEOUTS, *_BROKEN)):
        return True
    if isinstance(exc, ClientError):
        return client_error_code(exc) in _THROTTLED
    return False


def translate(exc: BaseException, what: str) -> FetchError:
    """The contract's error for a failure while doing `what` (e.g. 'GET s3://b/k')."""
    if isinstance(exc, FetchError):
        return exc
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return AccessDenied(f"{what}: no usable credentials found (env, Secret or default chain)")
    if isinstance(exc, ClientError):
        code = client_error_code(exc)
        if code in _NOT_FOUND:
            return NotFound(f"{what}: {code}")
        if code in _DENIED:
            return AccessDenied(f"{what}: {code}")
        if code in ("PreconditionFailed", "412"):
            return ChecksumMismatch(f"{what}: the object changed while it was being downloaded")
        if code in _THROTTLED:
            return Stalled(f"{what}: still failing after retries ({code})")
        return FetchError(f"{what}: {code}")
    if isinstance(exc, _TIMEOUTS):
        return Stalled(f"{what}: no data for too long (stall timeout), retries exhausted")
    if isinstance(exc, _BROKEN):
        return Stalled(f"{what}: connection failed after retries ({type(exc).__name__})")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"{what}: no space left on the destination filesystem")
    if isinstance(exc, BotoCoreError):
        return FetchError(f"{what}: {exc}")
    return FetchError(f"{what}: {type(exc).__name__}: {exc}")
