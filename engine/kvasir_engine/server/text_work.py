"""Tokenisation and detokenisation of what a client sent: bounded, and off the event loop.

A prompt is text of up to `--max-body-bytes`; tokenising 8 MB takes seconds of CPU. On the
asyncio loop that stalled `/health`, `/ready`, `/metrics` and every running stream (issue 39).
Two guards:

- **Refused by its length alone.** No token covers more characters than the longest string in
  the vocabulary, so a text longer than `max_model_len x that x NORMALIZER_SLACK` characters can
  never fit the context: 400 at once, nothing tokenised. The slack covers normalizers that fold
  several characters into one (NFC/NFKC composition); a normalizer that deleted more than
  three characters in four could see such a prompt refused although it would have fit, and
  none of the supported families' tokenizers does.
- **The rest in a small worker pool** (`run`), whose threads tokenise with the GIL released
  (`Tokenizer.encode` hands long texts to the batch encoder), so the loop keeps answering; the
  pool's size bounds how much of the host concurrent tokenisation may take.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvasir_engine.server.errors import bad_request

T = TypeVar("T")

NORMALIZER_SLACK = 4
# Tokenisation threads: two keep a burst of long prompts from taking every core from the engine.
DEFAULT_TEXT_WORKERS = 2


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for (its longest vocabulary string)."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=1)


class TextWork:
    def __init__(self, tokenizer: Any, max_model_len: int,
                 max_workers: int = DEFAULT_TEXT_WORKERS) -> None:
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * max_token_chars(tokenizer) * NORMALIZER_SLACK
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvasir-text")

    def check_fits(self, num_chars: int, param: str) -> None:
        """400 for a text that has more tokens than the context holds, by its length alone."""
        if num_chars > self.max_chars:
            raise bad_request(
                f"the prompt has {num_chars} characters, so more tokens than this model's "
                f"maximum context length of {self.max_model_len} tokens", param)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the text pool (tokenising, rendering, decoding), awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
