"""`IncrementalDetokenizer`: turn a growing list of token ids into text deltas, safely.

Byte-level tokens can end in the middle of a UTF-8 character (an emoji spans up to four
tokens). We decode a small window, from `prefix_offset` to the end, and compare it with the
text of the window's already-emitted part (`prefix_offset` to `read_offset`); the difference
is new text unless it ends in U+FFFD, the mark of an incomplete byte sequence, in which case
we wait for the next token. Decoding a window (not one token alone) keeps sentencepiece's
leading-space handling right, as vLLM's prefix-offset scheme does.

It also notes where each output token's text starts in `output_text` (`token_starts`), known once
the token's text is out: the output processor cuts logprobs at a stop string with it. Tokens
emitted together (a character spread over several byte tokens, or an invalid byte shown as
U+FFFD only once the next token arrives) share the text by decoding their prefixes.
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
        # Per output token whose text is out: where that text starts in output_text.
        self.token_starts: list[int] = []

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly "")."""
        delta = ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            delta += self._step(len(self.output_text) + len(delta))
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end],
                                     skip_special_tokens=self.skip_special_tokens)

    def _step(self, base: int) -> str:
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._note_starts(base, len(prefix_text), delta)
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta

    def _note_starts(self, base: int, prefix_len: int, delta: str) -> None:
        """Starts of the tokens read_offset.. whose text `delta` (at `base`) now is."""
        start = base
        for end_index in range(self.read_offset + 1, len(self.token_ids)):
            self.token_starts.append(start)
            # A prefix of the group whose text is a prefix of delta owns those characters.
            part = self._decode(self.prefix_offset, end_index)[prefix_len:]
            if delta.startswith(part):
                start = max(start, base + len(part))
        if self.read_offset < len(self.token_ids):
            self.token_starts.append(start)

    def flush(self) -> str:
        """At the end of a request: whatever is held back (a truly invalid byte sequence)."""
        text = self._decode(self.prefix_offset)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        delta = text[len(prefix_text):] if len(text) > len(prefix_text) else ""
        self._note_starts(len(self.output_text), len(prefix_text), delta)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta
