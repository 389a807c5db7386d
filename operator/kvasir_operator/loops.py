"""Per-object background tasks that need no finalizer: the periodic reconcile and the autoscaler.

kopf's `@kopf.timer` and `@kopf.daemon` put a finalizer on every object they serve, so that kopf
can stop them before the object goes; with the operator down, `kubectl delete` then hangs on it.
These tasks need no such guarantee (each one ends by itself when it finds its object gone), so
they are plain asyncio tasks, started from the object's watch events (`@kopf.on.event`, which
adds no finalizer) and cancelled on its DELETED event or at the operator's exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (object uid, loop name)


class ObjectLoops:
    """The running tasks, one per (object, loop name); one instance lives in kopf's memo."""

    def __init__(self) -> None:
        self._tasks: dict[Key, asyncio.Task[None]] = {}

    def ensure(self, uid: str, loop: str,
               factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start the loop unless it runs already (a loop that ended is started again)."""
        task = self._tasks.get((uid, loop))
        if task is not None and not task.done():
            return
        self._tasks[uid, loop] = asyncio.create_task(factory(), name=f"{loop} {uid}")

    def stop(self, uid: str, loop: str | None = None) -> None:
        """Cancel one loop of the object, or all of them."""
        for key in [k for k in self._tasks if k[0] == uid and loop in (None, k[1])]:
            self._tasks.pop(key).cancel()

    def running(self, uid: str) -> set[str]:
        return {k[1] for k, task in self._tasks.items() if k[0] == uid and not task.done()}

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
