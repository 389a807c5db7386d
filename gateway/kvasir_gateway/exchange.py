"""`Exchange`: what one admitted request consumed and answered, for its settlement.

The proxy makes one per admitted request and is its only owner: it changes it only through the
methods below, one per event of the request's path, and reads it for the three things that
follow the answer: the quota settlement (`tokens_to_settle`, exactly once), the cascade's cost
accounting (`finish`) and the shadow comparison (`answer`).

What a cascade's escalated attempts consumed is carried in `spent_tokens` as they go: the prompt
estimate as soon as an engine answered (`hold_prompt`, so a read cut off by the client is still
charged), replaced by the engine's usage once the answer was read whole.
"""

from __future__ import annotations

from typing import Any

from kvasir_gateway.checks import answer_text
from kvasir_gateway.sse import completion_tokens, usage_tokens


class Exchange:
    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens  # body.py's estimate, charged for cut-off attempts
        self.status = 0  # the relayed answer's HTTP status; 0: none, or cut off (incomplete)
        self.used_tokens: int | None = None  # the engine's usage of the answer read whole
        self.is_answered = False  # a replica answered with headers (no more retries)
        self.is_started = False  # the response's start went to the client
        self.spent_tokens = 0  # of a cascade's escalated attempts, settled with the answer
        self.attempts: list[tuple[str, int]] = []  # (model, completion tokens) of each answer
        self.final_completion_tokens: int | None = None
        self.answer: str | None = None  # the answer's text, for the shadow comparison

    # A cheaper pool of a cascade, asked for its whole answer.

    def hold_prompt(self) -> None:
        """An engine is reading the prompt: charged if the attempt is cut off now."""
        self.spent_tokens += self.prompt_tokens

    def release_prompt(self) -> None:
        """The attempt's answer was read whole: its own usage counts instead."""
        self.spent_tokens -= self.prompt_tokens

    def escalated(self, model: str, used_tokens: int, num_completion_tokens: int) -> None:
        """`model`'s answer failed a check: charged, and the next pool is asked."""
        self.spent_tokens += used_tokens
        self.attempts.append((model, num_completion_tokens))

    def answered_whole(self, answer: dict[str, Any], used_tokens: int,
                       num_completion_tokens: int) -> None:
        """A cheaper pool's answer passed every check; it goes to the client whole, next."""
        self.used_tokens, self.final_completion_tokens = used_tokens, num_completion_tokens
        self.is_answered, self.status = True, 200
        self.answer = answer_text(answer)
        self.is_started = True

    # The relayed answer (the last pool, or the only one).

    def replica_answered(self) -> None:
        self.is_answered = True

    def relaying(self, status: int) -> None:
        self.status = status

    def read_whole(self, answer: dict[str, Any]) -> None:
        """A 200 answer that was not streamed, read whole before it is relayed."""
        self.used_tokens = usage_tokens(answer.get("usage"))
        self.final_completion_tokens = completion_tokens(answer)
        self.answer = answer_text(answer)

    def response_started(self) -> None:
        self.is_started = True

    def cut_off(self) -> None:
        """The relay broke off or the client left: incomplete, no shadow, no cost accounting."""
        self.status = 0

    def streamed(self, num_completion_tokens: int | None, text: str | None) -> None:
        """A 200 answer relayed to its end: what the stream told, where nothing else did."""
        if self.final_completion_tokens is None:
            self.final_completion_tokens = num_completion_tokens
        if text is not None and self.answer is None:
            self.answer = text

    # What follows the answer.

    def finish(self, model: str) -> list[tuple[str, int]]:
        """`model` gave the final answer: every attempt's (model, completion tokens)."""
        self.attempts.append((model, self.final_completion_tokens or 0))
        return self.attempts

    def tokens_to_settle(self, streamed_used_tokens: int | None, num_chunks: int) -> int:
        """What the tenant is charged: the usage the engine reported (read whole, or at the
        stream's end), else (the client left, the upstream broke) the prompt estimate plus the
        chunks relayed, or nothing when no replica answered or it refused (an engine's 4xx
        consumed nothing); plus what escalated attempts used."""
        used = self.used_tokens if self.used_tokens is not None else streamed_used_tokens
        if used is None:
            is_charged = self.is_answered and self.status < 400
            used = self.prompt_tokens + num_chunks if is_charged else 0
        return used + self.spent_tokens
