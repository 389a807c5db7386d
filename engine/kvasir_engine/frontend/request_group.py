"""`RequestGroup`: the requests behind one HTTP call (n choices x prompts) and their output queue.

One asyncio queue per HTTP call keeps the choices of a stream in the order the engine produced
them. The engine thread never touches it: `EngineThread` puts items from the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvasir_engine.frontend.request_output import RequestOutput

# Requests the server makes itself (readiness probe, warm-up): kept out of user metrics and limits.
INTERNAL_PREFIX = "kvasir-internal-"


class Aborted:
    """Queue item: end every unfinished request of the group with finish_reason "abort"."""


class RequestGroup:
    def __init__(self, request_ids: list[str]) -> None:
        if not request_ids:
            raise ValueError("a request group needs at least one request id")
        self.request_ids = request_ids
        self.index_of = {rid: i for i, rid in enumerate(request_ids)}
        self.finished: set[str] = set()
        self.released = False
        self._queue: asyncio.Queue[RequestOutput | Aborted | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | Aborted | BaseException) -> None:
        self._queue.put_nowait(item)

    def unfinished_ids(self) -> list[str]:
        return [rid for rid in self.request_ids if rid not in self.finished]

    @property
    def is_finished(self) -> bool:
        return len(self.finished) == len(self.request_ids)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yields deltas until every request finished; raises what the engine reported."""
        while not self.is_finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Aborted):
                for rid in self.unfinished_ids():
                    self.finished.add(rid)
                    yield RequestOutput(request_id=rid, text_delta="", new_token_ids=[],
                                        new_logprobs=None, finish_reason="abort",
                                        stop_reason=None, num_prompt_tokens=0,
                                        num_output_tokens=0, num_cached_tokens=0)
                return
            if item.finish_reason is not None:
                self.finished.add(item.request_id)
            yield item
