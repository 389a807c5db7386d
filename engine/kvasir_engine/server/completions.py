"""`POST /v1/completions`: prompts (text or token ids) in, choices or an SSE stream out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvasir_engine.server import generation as g
from kvasir_engine.server.errors import bad_request
from kvasir_engine.server.protocol import CompletionRequest
from kvasir_engine.server.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
)
from kvasir_engine.server.sse import sse_response
from kvasir_engine.server.state import ServerState
from kvasir_engine.server.token_text import completion_logprobs

logger = logging.getLogger(__name__)


def _tokenize(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    prompts: list[list[int]] = []
    for i, prompt in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt.{i}"
        ids = list(state.tokenizer.encode(prompt)) if isinstance(prompt, str) else prompt
        if not ids:
            raise bad_request("the prompt encodes to no tokens", param)
        g.check_in_vocab(state, ids, param)
        prompts.append(ids)
    return prompts


async def create_completion(state: ServerState, req: CompletionRequest,
                            http_request: Request) -> Response:
    g.check_admitting(state)
    g.check_model(state, req.model)
    prompts = _tokenize(state, req)
    max_tokens = [g.resolve_max_tokens(state, len(p), req.max_tokens, "prompt") for p in prompts]
    job = g.build_job(state, "cmpl", req, prompts, max_tokens, req.logprobs)
    if state.server_config.log_requests:
        logger.info("request %s: prompts=%r params=%s", job.id, req.prompts, job.specs[0].params)
    await g.admit(state, job)
    echoes = [_echo(state, req, i) for i in range(len(prompts))]
    if req.stream:
        return sse_response(_stream(state, req, job, echoes))
    choices = await g.collect(state, job, http_request)
    created = int(time.time())
    body = CompletionResponse(
        id=job.id, created=created, model=state.model_name,
        system_fingerprint=state.system_fingerprint,
        choices=[CompletionChoice(
            index=c.index, text=echoes[c.prompt_index] + c.text,
            logprobs=(completion_logprobs(state.tokenizer, c.logprobs)
                      if req.logprobs is not None else None),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in choices],
        usage=g.usage_of(job, choices), kvasir=g.timings_of(choices))
    if state.server_config.log_requests:
        logger.info("response %s: %r", job.id, [c.text for c in choices])
    return JSONResponse(body.model_dump())


def _echo(state: ServerState, req: CompletionRequest, prompt_index: int) -> str:
    if not req.echo:
        return ""
    prompt = req.prompts[prompt_index]
    return prompt if isinstance(prompt, str) else str(state.tokenizer.decode(prompt))


async def _stream(state: ServerState, req: CompletionRequest, job: g.Job,
                  echoes: list[str]) -> AsyncIterator[BaseModel]:
    created = int(time.time())
    choices = job.new_choices()
    started: set[str] = set()
    offsets = dict.fromkeys(choices, 0)

    def chunk(choice_list: list[CompletionChoice]) -> CompletionChunk:
        return CompletionChunk(id=job.id, created=created, model=state.model_name,
                               system_fingerprint=state.system_fingerprint, choices=choice_list)

    async for out in g.stream_outputs(state, job):
        choice = choices[out.request_id]
        choice.add(out)
        text = out.text_delta
        if out.request_id not in started:
            started.add(out.request_id)
            text = echoes[choice.prompt_index] + text
        if not text and not out.is_finished and not out.new_logprobs:
            continue
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(state.tokenizer, out.new_logprobs or [],
                                           offsets[out.request_id])
            offsets[out.request_id] += sum(len(t) for t in logprobs.tokens)
        yield chunk([CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                      finish_reason=out.finish_reason,
                                      stop_reason=out.stop_reason)])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield g.with_usage(chunk([]), job, choices.values())
