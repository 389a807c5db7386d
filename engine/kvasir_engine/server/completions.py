"""`POST /v1/completions`: prompts (text or token ids) in, choices or an SSE stream out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvasir_engine.core.request import LogprobsEntry
from kvasir_engine.server import disagg
from kvasir_engine.server import generation as g
from kvasir_engine.server.auth import tenant_of
from kvasir_engine.server.errors import bad_request
from kvasir_engine.server.protocol import CompletionRequest
from kvasir_engine.server.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    Usage,
)
from kvasir_engine.server.sse import sse_response
from kvasir_engine.server.state import ServerState
from kvasir_engine.server.token_text import (
    completion_logprobs,
    echo_logprobs,
    extend,
    prompt_logprobs,
)

logger = logging.getLogger(__name__)


def tokenize_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    prompts: list[list[int]] = []
    """The prompts' token ids; runs on the text pool (`TextWork.run`), as it may take long."""
    for i, prompt in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            state.text_work.check_fits(len(prompt), param)
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
    prompts = await state.text_work.run(tokenize_prompts, state, req)
    # max_tokens 0 (echo only) still runs one step: the prompt's logprobs come with a sample,
    # which the answer then leaves out.
    requested = (1 if req.is_echo_only or disagg.is_prefill_only(req.kv_transfer_params)
                 else req.max_tokens)
    max_tokens = [g.resolve_max_tokens(state, len(p), requested, "prompt") for p in prompts]
    job = g.build_job(state, "cmpl", req, prompts, max_tokens, req.logprobs,
                      tenant_id=tenant_of(http_request),
                      num_prompt_logprobs=req.num_prompt_logprobs)
    if state.server_config.log_requests:
        logger.info("request %s: prompts=%r params=%s", job.id, req.prompts, job.specs[0].params)
    if state.tracer is not None:  # tracing.py
        job.trace = state.tracer.begin(http_request.headers, job.specs, job.n,
                                       lambda: [_echo(state, req, i, always=True)
                                                for i in range(len(prompts))])
    await g.admit(state, job)
    echoes = [_echo(state, req, i) for i in range(len(prompts))]
    if req.stream:
        return sse_response(_stream(state, req, job, echoes))
    choices = await g.collect(state, job, http_request)
    created = int(time.time())
    body = CompletionResponse(
        id=job.id, created=created, model=state.model_name,
        system_fingerprint=state.system_fingerprint,
        choices=[_choice(state, req, job, c, echoes[c.prompt_index], c.text, c.logprobs,
                         c.finish_reason, c.stop_reason, first=True) for c in choices],
        usage=_usage(req, job, choices), kvasir=g.timings_of(choices))
    if state.server_config.log_requests:
        logger.info("response %s: %r", job.id, [c.text for c in choices])
    return JSONResponse(disagg.with_transfer_params(body.model_dump(),
                                                    choices[0].kv_transfer_params))


def _echo(state: ServerState, req: CompletionRequest, prompt_index: int, *,
          always: bool = False) -> str:
    """The prompt's text when echoed (or `always`), decoded when given as token ids."""
    if not (req.echo or always):
        return ""
    prompt = req.prompts[prompt_index]
    return prompt if isinstance(prompt, str) else str(state.tokenizer.decode(prompt))


def _choice(state: ServerState, req: CompletionRequest, job: g.Job, choice: g.Choice, echo: str,
            text: str, entries: Sequence[LogprobsEntry], finish_reason: str | None,
            stop_reason: int | str | None, *, first: bool,
            text_offset: int = 0) -> CompletionChoice:
    """One choice (or its streamed delta): `first` puts the echoed prompt and its logprobs in
    front; `text_offset` is where `text` starts in the whole choice text."""
    if req.is_echo_only:  # the one sampled token is not part of the answer
        text, entries = "", ()
        if finish_reason in ("stop", "length"):  # it ended at its (zero) max_tokens
            finish_reason, stop_reason = "length", None
    tokenizer = state.tokenizer
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, entries, text_offset + len(echo) * first,
                                       req.logprobs)
        if req.echo and first:
            prompt = echo_logprobs(tokenizer, job.prompt_token_ids[choice.prompt_index],
                                   choice.prompt_logprobs, req.logprobs)
            logprobs = extend(prompt, logprobs)
    scored = None
    if req.prompt_logprobs is not None and first:
        scored = prompt_logprobs(tokenizer, choice.prompt_logprobs, req.prompt_logprobs)
    return CompletionChoice(index=choice.index, text=(echo if first else "") + text,
                            logprobs=logprobs, finish_reason=finish_reason,
                            stop_reason=stop_reason, prompt_logprobs=scored)


def _usage(req: CompletionRequest, job: g.Job, choices: Iterable[g.Choice]) -> Usage:
    usage = g.usage_of(job, list(choices))
    if req.is_echo_only:
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    return usage


async def _stream(state: ServerState, req: CompletionRequest, job: g.Job,
                  echoes: list[str]) -> AsyncIterator[BaseModel]:
    created = int(time.time())
    choices = job.new_choices()
    started: set[str] = set()
    # Where the next delta starts in each choice's text (after the echoed prompt).
    offsets = dict.fromkeys(choices, 0)

    def chunk(choice_list: list[CompletionChoice]) -> CompletionChunk:
        return CompletionChunk(id=job.id, created=created, model=state.model_name,
                               system_fingerprint=state.system_fingerprint, choices=choice_list)

    async for out in g.stream_outputs(state, job):
        choice = choices[out.request_id]
        choice.add(out)
        first = out.request_id not in started
        # The echoed prompt and the prompt logprobs go out at once, in the choice's first chunk.
        owes_prompt = first and (req.echo or req.prompt_logprobs is not None)
        has_news = bool(out.text_delta or out.new_logprobs) and not req.is_echo_only
        if not (owes_prompt or has_news or out.is_finished):
            continue
        started.add(out.request_id)
        echo = echoes[choice.prompt_index]
        yield chunk([_choice(state, req, job, choice, echo, out.text_delta,
                             out.new_logprobs or (), out.finish_reason, out.stop_reason,
                             first=first, text_offset=offsets[out.request_id])])
        offsets[out.request_id] += len(echo) * first + len(out.text_delta)
    if req.stream_options is not None and req.stream_options.include_usage:
        last = g.with_usage(chunk([]), job, choices.values())
        last.usage = _usage(req, job, choices.values())
        yield last
