"""`OutputProcessor`: token ids from the core -> text deltas, with stop strings applied.

Per request it keeps an incremental detokenizer and looks for stop strings in the text as it
grows, including ones spanning token boundaries. OpenAI semantics: the text ends just before
the stop string, which is never returned; while a request streams, the last
(longest stop string - 1) characters are held back, since they could be the start of a stop
string. A request stopped this way is reported in `stopped_req_ids` so the caller finishes it
in the core (FINISHED_STOPPED) and frees its blocks at once.

Logprobs follow the text: each token's entry waits until the text where that token starts is
emitted, and the tokens that start inside a removed stop string are dropped, so the `tokens` /
`token_logprobs` arrays a client sees end where `text` does (a token partly kept stays).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvasir_engine.core.outputs import EngineCoreOutput
from kvasir_engine.core.request import LogprobsEntry, Request
from kvasir_engine.frontend.detokenizer import IncrementalDetokenizer
from kvasir_engine.frontend.request_output import (
    FinishedRequestStats,
    RequestOutput,
    RequestTimings,
)
from kvasir_engine.tokenizer import Tokenizer


@dataclass
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    text: str = ""  # detokenized output, truncated at a stop string once one is found
    num_emitted_chars: int = 0
    num_output_tokens: int = 0
    # Logprobs of the output tokens from index num_emitted_logprobs on, not yet emitted.
    pending_logprobs: list[LogprobsEntry] = field(default_factory=list)
    num_emitted_logprobs: int = 0

    @property
    def hold_back(self) -> int:
        return max((len(s) for s in self.stop), default=1) - 1


@dataclass(frozen=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Requests that hit a stop string: the caller must finish them in the core.
    stopped_req_ids: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        self.states[request.request_id] = _RequestState(
            request=request,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                               params.skip_special_tokens),
            stop=params.stop,
        )

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Forget the requests; the final output (finish_reason "abort", its timings) of each
        that was still open, for the metrics: nobody streams it."""
        finals = []
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                request = state.request
                finals.append(RequestOutput(
                    request_id=request_id, text_delta="", new_token_ids=[], new_logprobs=None,
                    finish_reason="abort", stop_reason=None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=state.num_output_tokens,
                    num_cached_tokens=max(0, request.num_cached_tokens),
                    timings=_timings(request), finished=_finished_stats(request)))
        return finals

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        results: list[RequestOutput] = []
        stopped: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:  # finished or aborted earlier (e.g. by a stop string)
                continue
            finish_reason: str | None = out.finish_reason
            stop_reason: str | int | None = out.stop_reason
            is_first_token = state.num_output_tokens == 0 and bool(out.new_token_ids)
            state.num_output_tokens += len(out.new_token_ids)
            delta = state.detokenizer.add_tokens(out.new_token_ids)
            state.pending_logprobs += out.new_logprobs or ()
            if finish_reason is not None:
                delta += state.detokenizer.flush()
            found = self._find_stop(state, delta)
            if found is not None and finish_reason is None:
                stopped.append(out.request_id)
            if found is not None:
                finish_reason, stop_reason = "stop", found
            results.append(self._emit(state, out, finish_reason, stop_reason, found is not None,
                                      is_first_token))
            if finish_reason is not None:
                del self.states[out.request_id]
        return ProcessedOutputs(results, stopped)

    def _find_stop(self, state: _RequestState, delta: str) -> str | None:
        """Append delta to the text; if a stop string now appears, truncate before it."""
        previous = len(state.text)
        state.text += delta
        if not state.stop or not delta:
            return None
        best: tuple[int, str] | None = None
        for stop in state.stop:
            # Only a match overlapping the new text is new; earlier ones were checked before.
            index = state.text.find(stop, max(0, previous - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        state.text = state.text[: best[0]]
        return best[1]

    def _emit(self, state: _RequestState, out: EngineCoreOutput, finish_reason: str | None,
              stop_reason: str | int | None, is_stop_string: bool,
              is_first_token: bool) -> RequestOutput:
        end = len(state.text) if finish_reason is not None else max(
            state.num_emitted_chars, len(state.text) - state.hold_back)
        text_delta = state.text[state.num_emitted_chars:end]
        state.num_emitted_chars = end
        request = state.request
        return RequestOutput(
            request_id=out.request_id,
            text_delta=text_delta,
            new_token_ids=list(out.new_token_ids),
            new_logprobs=self._emitted_logprobs(state, out, finish_reason is not None,
                                                is_stop_string),
            prompt_logprobs=out.prompt_logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=max(0, out.num_cached_tokens),
            timings=_timings(request) if finish_reason is not None else None,
            finished=_finished_stats(request) if finish_reason is not None else None,
            ttft_seconds=_ttft(request) if is_first_token else None,
        )


    @staticmethod
    def _emitted_logprobs(state: _RequestState, out: EngineCoreOutput, is_finished: bool,
                          is_stop_string: bool) -> list[LogprobsEntry] | None:
        """The pending entries whose token starts in the text emitted so far (all of them at a
        finish, except those a stop string cut away)."""
        if out.new_logprobs is None and not state.pending_logprobs:
            return None
        pending = state.pending_logprobs
        num_ready = len(pending)
        if not is_finished or is_stop_string:
            starts = state.detokenizer.token_starts[state.num_emitted_logprobs:]
            num_ready = next((i for i, start in enumerate(starts[:len(pending)])
                              if start >= state.num_emitted_chars), min(len(starts), num_ready))
        state.pending_logprobs = [] if is_finished else pending[num_ready:]
        state.num_emitted_logprobs += num_ready
        return pending[:num_ready]


def _timings(request: Request) -> RequestTimings | None:
    scheduled, first, done = (request.first_scheduled_time, request.first_token_time,
                              request.finished_time)
    if scheduled is None or first is None:
        return None
    end = done if done is not None else time.monotonic()
    return RequestTimings(
        queue_seconds=scheduled - request.arrival_time,
        prefill_seconds=first - scheduled,
        decode_seconds=end - first,
        e2e_seconds=end - request.arrival_time,
    )


def _ttft(request: Request) -> float | None:
    first = request.first_token_time
    return None if first is None else first - request.arrival_time


def _finished_stats(request: Request) -> FinishedRequestStats:
    """vLLM's phases (stats.py): decode ends at the last token, not at a later abort or failure;
    a request stopped by a stop string is finished in the core just after this."""
    scheduled, first, last = (request.first_scheduled_time, request.first_token_time,
                              request.last_token_time)
    done = request.finished_time if request.finished_time is not None else time.monotonic()
    return FinishedRequestStats(
        e2e_seconds=done - request.arrival_time,
        queue_seconds=None if scheduled is None else scheduled - request.arrival_time,
        prefill_seconds=None if scheduled is None or first is None else first - scheduled,
        decode_seconds=None if first is None or last is None else last - first,
        max_tokens=request.sampling_params.max_tokens)
