"""The shared path of both generation endpoints: check, admit, collect, and account.

Turns validated wire parameters into `SamplingParams` and `RequestSpec`s (n choices per prompt),
refuses what can never fit with the numbers in the message, admits through `AsyncEngine`, and
accumulates the deltas into `Choice`s and `usage`. The endpoint modules only format.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from kvasir_engine.core.limits import QueueFullError
from kvasir_engine.core.request import ANONYMOUS_TENANT, LogprobsEntry, SamplingParams
from kvasir_engine.frontend.engine_types import EngineDeadError, RequestSpec
from kvasir_engine.frontend.request_group import RequestGroup
from kvasir_engine.frontend.request_output import RequestOutput, RequestTimings
from kvasir_engine.server import disagg
from kvasir_engine.server.errors import APIError, ClientGone, bad_request
from kvasir_engine.server.protocol import KVTransferParams, SamplingFields
from kvasir_engine.server.responses import (
    ChatCompletionChunk,
    CompletionChunk,
    PromptTokensDetails,
    Timings,
    Usage,
)
from kvasir_engine.server.state import ServerState
from kvasir_engine.server.tenants import cache_salt_for
from kvasir_engine.server.tracing import JobTrace

logger = logging.getLogger(__name__)

# vLLM's floor for a positive temperature (its _MAX_TEMP): see `floor_temperature`.
MIN_TEMPERATURE = 0.01


@dataclass
class Choice:
    index: int
    prompt_index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a producer's answer (disagg.py)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, out: RequestOutput) -> None:
        self.text_parts.append(out.text_delta)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.timings = out.timings


@dataclass
class Job:
    """One HTTP generation call: its request ids (choice order) and prompts."""

    id: str
    prompt_token_ids: list[list[int]]
    n: int
    specs: list[RequestSpec]
    group: RequestGroup | None = None
    # Its spans' parent and start (tracing.py); None: tracing off.
    trace: JobTrace | None = None
    # Disaggregated prefill's params as asked (disagg.py), or None.
    kv_transfer_params: KVTransferParams | None = None

    def new_choices(self) -> dict[str, Choice]:
        return {spec.request_id: Choice(index=i, prompt_index=i // self.n)
                for i, spec in enumerate(self.specs)}


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        # 404, as OpenAI and vLLM answer a model that does not exist.
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", param="model", code="model_not_found")


def check_admitting(state: ServerState) -> None:
    if state.is_draining:
        raise APIError(503, "the server is shutting down", code="draining")


def check_in_vocab(state: ServerState, token_ids: Sequence[int], param: str) -> None:
    """Token ids the model does not have are the client's mistake: 400 naming the field."""
    vocab = state.engine_config.model.arch.vocab_size
    bad = [t for t in token_ids if t >= vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {vocab})", param)


def resolve_max_tokens(state: ServerState, num_prompt_tokens: int, requested: int | None,
                       prompt_param: str) -> int:
    """max_tokens as asked, or all the context leaves; 400 (the core's `fit_error`, naming the
    field at fault) when the request could never be scheduled."""
    max_tokens = (requested if requested is not None
                  else max(state.max_model_len - num_prompt_tokens, 1))
    never = state.fit_error(num_prompt_tokens, max_tokens)
    if never is not None:
        raise bad_request(never.message, prompt_param if never.field == "prompt" else never.field)
    return max_tokens


def sampling_params(req: SamplingFields, max_tokens: int, num_logprobs: int | None,
                    choice: int, num_prompt_logprobs: int | None = None, *,
                    vocab_size: int) -> SamplingParams:
    # Each of the n choices gets its own seed, so n > 1 with a seed still gives n samples.
    seed = None if req.seed is None else (req.seed + choice) % 2**63
    given = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty") if getattr(req, name) is not None}
    if req.top_k is not None and req.top_k > vocab_size:
        raise bad_request(f"top_k: must be <= the vocabulary size ({vocab_size}) or -1 / 0 to "
                          f"disable, got {req.top_k}", "top_k")
    if "temperature" in given:
        given["temperature"] = floor_temperature(given["temperature"])
    try:
        return SamplingParams(**given, seed=seed, max_tokens=max_tokens,
                              min_tokens=req.min_tokens, stop=req.stop_strings,
                              stop_token_ids=tuple(req.stop_token_ids or ()),
                              ignore_eos=req.ignore_eos, logprobs=num_logprobs,
                              prompt_logprobs=num_prompt_logprobs,
                              skip_special_tokens=req.skip_special_tokens)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(":")[0]) from None


def floor_temperature(temperature: float) -> float:
    """vLLM's rule: a positive temperature below `MIN_TEMPERATURE` is raised to it (logits
    divided by 1e-40 overflow to inf, and the sample is garbage); 0 stays greedy."""
    if 0 < temperature < MIN_TEMPERATURE:
        logger.warning("temperature %g is below %g, which overflows the scores; using %g",
                       temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
        return MIN_TEMPERATURE
    return temperature


def build_job(state: ServerState, kind: str, req: SamplingFields, prompts: list[list[int]],
              max_tokens: list[int], num_logprobs: int | None, *,
              tenant_id: str = ANONYMOUS_TENANT,
              num_prompt_logprobs: int | None = None) -> Job:
    check_fan_out(state, len(prompts), req.n)
    check_in_vocab(state, req.stop_token_ids or (), "stop_token_ids")
    disagg.check_request(state, req.kv_transfer_params, len(prompts), req.n, bool(req.stream),
                         num_prompt_logprobs is not None)
    job_id = f"{kind}-{uuid.uuid4().hex}"
    salt = cache_salt_for(tenant_id, state.server_config.prefix_cache_shared_tenants,
                          req.cache_salt)
    vocab_size = state.engine_config.model.arch.vocab_size
    specs = [RequestSpec(f"{job_id}-{p}-{i}", ids,
                         sampling_params(req, max_tokens[p], num_logprobs, i,
                                         num_prompt_logprobs, vocab_size=vocab_size),
                         tenant_id=tenant_id, cache_salt=salt, parent_id=f"{job_id}-{p}")
             for p, ids in enumerate(prompts) for i in range(req.n)]
    return Job(job_id, prompts, req.n, specs, kv_transfer_params=req.kv_transfer_params)


def check_fan_out(state: ServerState, num_prompts: int, n: int) -> None:
    """400 for a request that could never be admitted (admission.py); retrying cannot help."""
    if n > state.server_config.max_n:
        raise bad_request(f"n must be <= {state.server_config.max_n}, got {n}", "n")
    never = state.admission_limits.check_request(num_prompts, n)
    if never is not None:
        raise APIError(400, never[0], param=never[1], code="too_many_sequences")


def _engine_dead(error: EngineDeadError) -> APIError:
    return APIError(503, str(error), code="engine_dead")


def _check_not_failed(job: Job, out: RequestOutput) -> None:
    """A request the engine failed on its own data (`RequestError`; the others carried on):
    500 naming the request, whose reason is in the server log."""
    if out.finish_reason == "error":
        raise APIError(500, f"the engine could not run request {out.request_id} of {job.id}; "
                            f"the server log has the reason under that id",
                       code="request_failed")


async def admit(state: ServerState, job: Job) -> None:
    """Admits the job's requests (a consumer's first receive their prompts' K/V, disagg.py);
    429, 503 or 400 when the engine refuses them."""
    job.specs = await disagg.receive_blocks(state, job.kv_transfer_params, job.specs)
    try:
        await _add(state, job)
    except BaseException:
        disagg.discard_staged(state, job.specs)
        raise


async def _add(state: ServerState, job: Job) -> None:
    try:
        job.group = await state.async_engine.add(job.specs)
    except QueueFullError as e:
        state.metrics.observe_tenant_refused(job.specs[0].tenant_id)
        retry = str(state.server_config.retry_after_seconds)
        raise APIError(429, f"the server is busy: {e}", code="queue_full",
                       headers={"Retry-After": retry}) from None
    except EngineDeadError as e:
        raise _engine_dead(e) from None
    except ValueError as e:
        raise bad_request(str(e)) from None


async def _wait_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(state: ServerState, job: Job, http_request: Request) -> list[Choice]:
    """Waits for every choice; aborts the job if the client goes away first."""
    assert job.group is not None
    choices = job.new_choices()

    async def consume() -> None:
        assert job.group is not None
        async for out in job.group.outputs():
            _trace_output(state, job, out)
            _check_not_failed(job, out)
            choices[out.request_id].add(out)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(http_request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            raise ClientGone(f"aborted {job.id}")
        consumer.result()
    except EngineDeadError as e:
        raise _engine_dead(e) from None
    finally:
        consumer.cancel()
        watcher.cancel()
        state.async_engine.release(job.group)
        disagg.discard_staged(state, job.specs)
        _close_trace(state, job)
    return sorted(choices.values(), key=lambda c: c.index)


async def stream_outputs(state: ServerState, job: Job) -> AsyncIterator[RequestOutput]:
    """The job's deltas as they come; releasing (aborting) whatever is left when it stops."""
    assert job.group is not None
    try:
        async for out in job.group.outputs():
            _trace_output(state, job, out)
            _check_not_failed(job, out)
            yield out
    except EngineDeadError as e:
        # Mid-stream, so it leaves as an SSE error event (sse.py) with the status it would have had.
        raise _engine_dead(e) from None
    finally:
        state.async_engine.release(job.group)
        disagg.discard_staged(state, job.specs)
        _close_trace(state, job)


def _trace_output(state: ServerState, job: Job, out: RequestOutput) -> None:
    if job.trace is not None and state.tracer is not None and out.is_finished:
        state.tracer.finish(job.trace, out)


def _close_trace(state: ServerState, job: Job) -> None:
    if job.trace is not None and state.tracer is not None:
        state.tracer.close(job.trace)


def usage_of(job: Job, choices: Sequence[Choice]) -> Usage:
    num_prompt = sum(len(p) for p in job.prompt_token_ids)
    num_completion = sum(len(c.token_ids) for c in choices)
    # The first choice of each prompt says how much of that prompt the prefix cache served.
    cached = sum(c.num_cached_tokens for c in choices if c.index % job.n == 0)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_completion,
                 total_tokens=num_prompt + num_completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def timings_of(choices: Sequence[Choice]) -> Timings | None:
    known = [c.timings for c in choices if c.timings is not None]
    if not known:
        return None
    return Timings(queue_seconds=max(t.queue_seconds for t in known),
                   prefill_seconds=max(t.prefill_seconds for t in known),
                   decode_seconds=max(t.decode_seconds for t in known),
                   e2e_seconds=max(t.e2e_seconds for t in known))


Chunk = TypeVar("Chunk", ChatCompletionChunk, CompletionChunk)


def with_usage(last: Chunk, job: Job, choices: Iterable[Choice]) -> Chunk:
    """The closing chunk of a stream that asked for `stream_options.include_usage`."""
    final = list(choices)
    last.usage = usage_of(job, final)
    last.kvasir = timings_of(final)
    return last
