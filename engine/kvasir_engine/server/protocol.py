"""OpenAI-compatible request schemas, validated strictly (unknown fields are a 400, not ignored).

Field names, defaults and ranges follow OpenAI's API and vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`), so existing clients work unchanged and a
typo in a parameter name is reported instead of silently doing nothing. Response shapes live in
`responses.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    model_validator,
)

from kvasir_engine.core.request import MAX_LOGPROBS

# Every integer is bounded by the C type the engine holds it in, so no value the schema lets
# through can overflow later in a tensor (issue 39: a top_k of 2**63 once killed the engine
# loop): token ids and counts are int32, seeds int64. Integers are strict (a JSON number, never
# "16"), as booleans are; floats take JSON numbers only, and never NaN or infinity.
INT32_MAX = 2**31 - 1
MAX_SEED = 2**63 - 1
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
# Bounds keep a single request from asking for absurd work before the token checks run.
MAX_STOP_STRINGS = 16
# A repetition penalty divides (or multiplies) logits by itself: below this floor the scores
# overflow and the output is garbage, so such a value is refused rather than obeyed.
MIN_REPETITION_PENALTY = 0.01


def _invalid_text(value: object, path: str) -> str | None:
    """The first string under `value` that is not valid Unicode text (a lone UTF-16 surrogate
    such as a JSON "\\ud800" decodes to one), as "path: reason"; None when all are valid."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"{path}: not valid Unicode text (a lone surrogate "
                    f"{value[e.start]!a} at character {e.start})")
        return None
    if isinstance(value, (list, tuple)):
        items: list[tuple[str, object]] = [(f"{path}.{i}", v) for i, v in enumerate(value)]
    elif isinstance(value, dict):
        items = [(f"{path}.{k}", v) for k, v in value.items()]
        items += [(path, k) for k in value]
    else:
        return None  # numbers, booleans, None; nested models check their own fields
    for item_path, item in items:
        found = _invalid_text(item, item_path)
        if found is not None:
            return found
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="after")
    def _check_text(self) -> _Strict:
        # Text that cannot be encoded would crash the tokenizer later: refuse it here, naming it.
        for name in type(self).model_fields:
            found = _invalid_text(getattr(self, name), name)
            if found is not None:
                raise ValueError(found)
        return self


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class KVTransferParams(_Strict):
    """vLLM's `kv_transfer_params` (disaggregated prefill, docs/disaggregation.md): a prefill
    request says `do_remote_decode`; its answer's params, with `do_remote_prefill`, go into
    the decode request. The `remote_*` fields are null in a prefill request (vLLM's proxy)."""

    do_remote_decode: StrictBool = False
    do_remote_prefill: StrictBool = False
    remote_engine_id: str | None = Field(None, min_length=1, max_length=256)
    remote_host: str | None = Field(None, min_length=1, max_length=253)
    remote_port: StrictInt | None = Field(None, ge=1, le=65535)
    # Ours: the transfer's handle at the producer (its request id).
    remote_request_id: str | None = Field(None, min_length=1, max_length=256)
    # The producer's block ids, as vLLM's producer reports them; read by nobody here.
    remote_block_ids: list[TokenId] | None = Field(None, max_length=1 << 20)
    tp_size: StrictInt | None = Field(None, ge=1, le=1024)

    @model_validator(mode="after")
    def _check_roles(self) -> KVTransferParams:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_prefill: excludes do_remote_decode (a request is "
                             "either a producer's or a consumer's)")
        if self.do_remote_prefill:
            for name in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}: required with do_remote_prefill")
        if self.remote_port is not None and self.remote_port + (self.tp_size or 1) > 65536:
            raise ValueError("tp_size: the producer's rank r serves on remote_port + r, which "
                             "must be <= 65535")
        return self


class SamplingFields(_Strict):
    """Parameters shared by both endpoints (mapped onto `SamplingParams`)."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=INT32_MAX)
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    # At most the vocabulary, checked where it is known (generation.sampling_params).
    top_k: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: StrictFloat | None = Field(None, ge=0, le=1)
    presence_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    repetition_penalty: StrictFloat | None = Field(None, ge=MIN_REPETITION_PENALTY, le=2)
    seed: StrictInt | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: StrictBool = True
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    # vLLM's field: salts this request's prefix-cache blocks, on top of the tenant's own salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's: disaggregated prefill and decode (server/disagg.py).
    kv_transfer_params: KVTransferParams | None = None

    @model_validator(mode="after")
    def _check_shared(self) -> SamplingFields:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        max_new_tokens = self.max_new_tokens
        if max_new_tokens is not None and self.min_tokens > max_new_tokens:
            # vLLM's rule: a floor above the ceiling is the client's mistake, not clamped.
            raise ValueError(f"min_tokens: must be <= max_tokens ({max_new_tokens}), "
                             f"got {self.min_tokens}")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """The most tokens to generate, as the endpoint's fields say (None: up to the context)."""
        raise NotImplementedError

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


PromptTokens = Annotated[list[TokenId], Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: (PromptText | PromptTokens
             | Annotated[list[PromptText], Field(min_length=1)]
             | Annotated[list[PromptTokens], Field(min_length=1)])
    # 0 only with echo: the prompt's own logprobs, nothing generated (lm-eval's loglikelihood).
    max_tokens: StrictInt | None = Field(16, ge=0, le=INT32_MAX)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    # vLLM's: top alternatives per prompt position, returned as each choice's prompt_logprobs.
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be >= 1 unless echo is true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def is_echo_only(self) -> bool:
        """The prompt back (with its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt position the engine must score (echo's and vLLM's)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                  if k is not None]
        return max(wanted) if wanted else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.tools:
            raise ValueError("tools: tool calling is not supported")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True


def _tokenize_kind(body: Any) -> str:
    return "<chat>" if isinstance(body, dict) and "messages" in body else "<prompt>"


# `/tokenize` takes either shape; the discriminator picks one by its `messages` key, so a bad
# body reports that shape's errors only, not both members'. The tags are not identifiers, so
# `errors._param_of` leaves them out of the parameter's name.
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("<chat>")] | Annotated[TokenizeCompletionRequest,
                                                              Tag("<prompt>")],
    Discriminator(_tokenize_kind)]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]
