"""Token ids and `LogprobsEntry`s to the shapes OpenAI's and vLLM's logprobs fields carry.

Completions (OpenAI's legacy shape): `top_logprobs` holds the top alternatives plus the token
itself when it is not among them (up to logprobs + 1 entries, as OpenAI documents; keyed by
text, so tokens of equal text share one entry, the likelier one's); with `echo`
the prompt's tokens come first, the first with a null logprob (nothing precedes it). Chat keeps
OpenAI's chat shape: the token at the head, exactly `top_logprobs` alternatives under it.
vLLM's `prompt_logprobs`: per prompt token a dict keyed by token id with logprob, rank and text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvasir_engine.core.request import LogprobsEntry
from kvasir_engine.server.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
)


def token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def _clean(logprob: float) -> float:
    # JSON has no -inf; OpenAI reports -9999.0 for impossible tokens.
    return logprob if logprob > -9999.0 else -9999.0


def _top_dict(tokenizer: Any, entry: LogprobsEntry, num_top: int) -> dict[str, float]:
    top: dict[str, float] = {}
    for t, lp in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top], strict=False):
        top.setdefault(token_text(tokenizer, t), _clean(lp))
    if entry.token_id not in entry.top_token_ids[:num_top]:
        # Under a shared text the likelier token's value stays, so "is the token the argmax"
        # (lm-eval's is_greedy: its logprob == max(top)) still reads right.
        top.setdefault(token_text(tokenizer, entry.token_id), _clean(entry.logprob))
    return top


def completion_logprobs(tokenizer: Any, entries: Sequence[LogprobsEntry], start_offset: int = 0,
                        num_top: int | None = None) -> CompletionLogprobs:
    """`num_top` None keeps every alternative the entries carry."""
    out = CompletionLogprobs()
    offset = start_offset
    for e in entries:
        text = token_text(tokenizer, e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_clean(e.logprob))
        out.top_logprobs.append(_top_dict(tokenizer, e, len(e.top_token_ids)
                                          if num_top is None else num_top))
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echo_logprobs(tokenizer: Any, prompt_token_ids: Sequence[int],
                  prompt_entries: Sequence[LogprobsEntry] | None,
                  num_top: int) -> CompletionLogprobs:
    """The prompt's part of an echoed completion; entries score tokens 1.. (None: unknown, as
    for a request aborted before its prefill finished)."""
    out = CompletionLogprobs(tokens=[token_text(tokenizer, prompt_token_ids[0])],
                             token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    if prompt_entries is None:
        for token_id in prompt_token_ids[1:]:
            out.text_offset.append(out.text_offset[-1] + len(out.tokens[-1]))
            out.tokens.append(token_text(tokenizer, token_id))
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        return out
    extend(out, completion_logprobs(tokenizer, prompt_entries, len(out.tokens[0]), num_top))
    return out


def extend(out: CompletionLogprobs, more: CompletionLogprobs) -> CompletionLogprobs:
    out.tokens += more.tokens
    out.token_logprobs += more.token_logprobs
    out.top_logprobs += more.top_logprobs
    out.text_offset += more.text_offset
    return out


def prompt_logprobs(tokenizer: Any, prompt_entries: Sequence[LogprobsEntry] | None,
                    num_top: int) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` of one choice: [None, {token id: Logprob}, ...]."""
    if prompt_entries is None:
        return None
    result: list[dict[str, PromptLogprob] | None] = [None]
    for e in prompt_entries:
        position = {str(e.token_id): PromptLogprob(logprob=_clean(e.logprob), rank=e.rank or None,
                                                   decoded_token=token_text(tokenizer,
                                                                            e.token_id))}
        for rank, (t, lp) in enumerate(zip(e.top_token_ids[:num_top], e.top_logprobs[:num_top],
                                           strict=False), start=1):
            position.setdefault(str(t), PromptLogprob(
                logprob=_clean(lp), rank=rank, decoded_token=token_text(tokenizer, t)))
        result.append(position)
    return result


def _top(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=_clean(logprob), bytes=list(text.encode()))


def chat_logprobs(tokenizer: Any, entries: list[LogprobsEntry]) -> ChatLogprobs:
    content = []
    for e in entries:
        head = _top(tokenizer, e.token_id, e.logprob)
        content.append(TokenLogprob(**head.model_dump(), top_logprobs=[
            _top(tokenizer, t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs,
                                                    strict=False)]))
    return ChatLogprobs(content=content)
