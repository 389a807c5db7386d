"""Which requests' own data broke a batch: the runner's half of failure isolation.

A batch is built and sampled as a whole, so an exception there (a value no tensor holds, a
sampling setting the math rejects) names no request. Only on that error path, each request is
tried alone: those that fail alone are to blame (`RequestError`, which `EngineCore` turns into an
error for them and a re-plan for the others). When none fails alone the batch itself is broken,
and the original exception propagates: that is the engine's failure, not a request's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvasir_engine.core.outputs import RequestError

logger = logging.getLogger(__name__)


def blame(request_ids: Sequence[str], try_alone: Callable[[str], object],
          error: Exception) -> RequestError | None:
    """The `RequestError` naming every request for which `try_alone` raises, or None."""
    failed: dict[str, str] = {}
    for request_id in request_ids:
        try:
            try_alone(request_id)
        except Exception as e:  # noqa: BLE001 - any failure alone is this request's
            failed[request_id] = f"{type(e).__name__}: {e}"
    if not failed:
        logger.error("a batch failed but none of its %d requests fails alone: %r",
                     len(request_ids), error)
        return None
    reason = "; ".join(f"{rid}: {why}" for rid, why in failed.items())
    return RequestError(failed, reason)
