"""Token ids to the strings OpenAI's logprobs fields carry."""

from __future__ import annotations

from typing import Any

from kvasir_engine.core.request import LogprobsEntry
from kvasir_engine.server.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)


def token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def _clean(logprob: float) -> float:
    # JSON has no -inf; OpenAI reports -9999.0 for impossible tokens.
    return logprob if logprob > -9999.0 else -9999.0


def completion_logprobs(tokenizer: Any, entries: list[LogprobsEntry],
                        start_offset: int = 0) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = start_offset
    for e in entries:
        text = token_text(tokenizer, e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_clean(e.logprob))
        out.top_logprobs.append({token_text(tokenizer, t): _clean(lp)
                                 for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=False)})
        out.text_offset.append(offset)
        offset += len(text)
    return out


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
