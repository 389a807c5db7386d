"""`IncrementalDetokenizer`: turn a growing list of token ids into text deltas, safely.

Byte-level tokens can end in the middle of a UTF-8 character (an emoji spans up to four
tokens). We decode a small window, from `prefix_offset` to the end, and compare it with the
text of the window's already-emitted part (`prefix_offset` to `read_offset`); the difference
is new text unless it ends in U+FFFD, the mark of an incomplete byte sequence, in which case
we wait for the next token. Decoding a window (not one token alone) keeps sentencepiece's
leading-space handling right, as vLLM's prefix-offset scheme does.
"""

from __future__ import annotations

from kvasir_engine.tokenizer import Tokenizer

# Prompt tokens kept as left context of the first window.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly "")."""
        delta = ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            delta += self._step()
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end],
                                     skip_special_tokens=self.skip_special_tokens)

    def _step(self) -> str:
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of a request: whatever is held back (a truly invalid byte sequence)."""
        text = self._decode(self.prefix_offset)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        delta = text[len(prefix_text):] if len(text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta
