"""Server-sent events: OpenAI's `data: {json}` framing, ending with `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kvasir_engine.server.errors import APIError, error_body

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


async def _frame(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    # The status line has gone out already: a failure mid-stream travels as an error event.
    try:
        async for chunk in chunks:
            yield event(chunk)
    except APIError as e:
        yield f"data: {json.dumps(error_body(e.status, e.message, e.param, e.code))}\n\n"
    except Exception:
        logger.exception("stream failed")
        yield f"data: {json.dumps(error_body(500, 'internal error while streaming'))}\n\n"
    yield DONE


def sse_response(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    return StreamingResponse(_frame(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
