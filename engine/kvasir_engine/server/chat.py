"""`POST /v1/chat/completions`: messages through the model's chat template, then generation."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvasir_engine.server import disagg
from kvasir_engine.server import generation as g
from kvasir_engine.server.auth import tenant_of
from kvasir_engine.server.errors import bad_request
from kvasir_engine.server.protocol import ChatCompletionRequest, ChatMessage
from kvasir_engine.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    DeltaMessage,
)
from kvasir_engine.server.sse import sse_response
from kvasir_engine.server.state import ServerState
from kvasir_engine.server.token_text import chat_logprobs

logger = logging.getLogger(__name__)


def encode_messages(state: ServerState, messages: list[ChatMessage],
                    add_generation_prompt: bool = True) -> list[int]:
    """The conversation's token ids; runs on the text pool (`TextWork.run`), as it may take
    long."""
    plain = [{"role": m.role, "content": m.text} for m in messages]
    state.text_work.check_fits(sum(len(m["content"]) for m in plain), "messages")
    try:
        text = state.tokenizer.apply_chat_template(plain,
                                                   add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template rejecting the conversation is bad input
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    ids = list(state.tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise bad_request("the messages encode to no tokens", "messages")
    return ids


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                 http_request: Request) -> Response:
    g.check_admitting(state)
    g.check_model(state, req.model)
    prompt = await state.text_work.run(encode_messages, state, req.messages,
                                       req.add_generation_prompt)
    max_tokens = g.resolve_max_tokens(
        state, len(prompt), 1 if disagg.is_prefill_only(req.kv_transfer_params)
        else req.max_new_tokens, "messages")
    job = g.build_job(state, "chatcmpl", req, [prompt], [max_tokens], req.num_logprobs,
                      tenant_id=tenant_of(http_request))
    if state.server_config.log_requests:
        logger.info("request %s: messages=%r params=%s", job.id,
                    [m.model_dump() for m in req.messages], job.specs[0].params)
    if state.tracer is not None:  # tracing.py
        job.trace = state.tracer.begin(http_request.headers, job.specs, job.n,
                                       lambda: [json.dumps([{"role": m.role, "content": m.text}
                                                            for m in req.messages])])
    await g.admit(state, job)
    if req.stream:
        return sse_response(_stream(state, req, job))
    choices = await g.collect(state, job, http_request)
    body = ChatCompletionResponse(
        id=job.id, created=int(time.time()), model=state.model_name,
        system_fingerprint=state.system_fingerprint,
        choices=[ChatChoice(
            index=c.index, message=AssistantMessage(content=c.text),
            logprobs=chat_logprobs(state.tokenizer, c.logprobs) if req.logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in choices],
        usage=g.usage_of(job, choices), kvasir=g.timings_of(choices))
    if state.server_config.log_requests:
        logger.info("response %s: %r", job.id, [c.text for c in choices])
    return JSONResponse(disagg.with_transfer_params(body.model_dump(),
                                                    choices[0].kv_transfer_params))


async def _stream(state: ServerState, req: ChatCompletionRequest,
                  job: g.Job) -> AsyncIterator[BaseModel]:
    created = int(time.time())
    choices = job.new_choices()

    def chunk(choice_list: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=job.id, created=created, model=state.model_name,
                                   system_fingerprint=state.system_fingerprint,
                                   choices=choice_list)

    # OpenAI opens each choice with the role and an empty content.
    yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
                 for c in choices.values()])
    async for out in g.stream_outputs(state, job):
        choice = choices[out.request_id]
        choice.add(out)
        if not out.text_delta and not out.is_finished and not out.new_logprobs:
            continue
        logprobs = (chat_logprobs(state.tokenizer, out.new_logprobs or [])
                    if req.logprobs else None)
        delta = DeltaMessage(content=out.text_delta) if out.text_delta else DeltaMessage()
        yield chunk([ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs,
                                     finish_reason=out.finish_reason,
                                     stop_reason=out.stop_reason)])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield g.with_usage(chunk([]), job, choices.values())
