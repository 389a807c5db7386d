"""Logprobs follow the text through the output processor: cut at a stop string, held back with
the text a stop string might still claim, and exact around characters spread over byte tokens."""

from __future__ import annotations

import pytest
from kvasir_engine.core.outputs import EngineCoreOutput
from kvasir_engine.core.request import LogprobsEntry, Request, SamplingParams
from kvasir_engine.frontend.detokenizer import IncrementalDetokenizer
from kvasir_engine.frontend.output_processor import OutputProcessor
from kvasir_engine.tokenizer import Tokenizer

TEXT = "Hello world! Grüße aus Köln 🚀 and the lazy dog."


def entry(token_id: int) -> LogprobsEntry:
    return LogprobsEntry(token_id, -float(token_id) / 1000)  # a value that names its token


def run(tokenizer: Tokenizer, stop: tuple[str, ...], step: int = 1, text: str = TEXT
        ) -> tuple[str, list[LogprobsEntry], list[tuple[str, list[LogprobsEntry]]]]:
    """Feeds TEXT's tokens `step` at a time with logprobs; (text, all entries, per output
    (text delta, entries))."""
    processor = OutputProcessor(tokenizer)
    processor.add_request(Request("r", tokenizer.encode("Say:"),
                                  SamplingParams(stop=stop, logprobs=0, max_tokens=64)))
    ids = tokenizer.encode(text)
    out_text, per_output = "", []
    for start in range(0, len(ids), step):
        chunk = ids[start:start + step]
        last = start + step >= len(ids)
        core = EngineCoreOutput("r", chunk, [entry(t) for t in chunk],
                                finish_reason="length" if last else None)
        for out in processor.process_outputs([core]).request_outputs:
            out_text += out.text_delta
            per_output.append((out.text_delta, list(out.new_logprobs or [])))
            if out.is_finished:
                return out_text, [e for _, lp in per_output for e in lp], per_output
    raise AssertionError("never finished")


def token_starts(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """Brute force: token i starts after the text of tokens 0..i-1 wherever that text is a
    prefix of the whole text (a partial character owns nothing until completed)."""
    whole = tokenizer.decode(ids)
    starts, owned = [], 0
    for i in range(len(ids)):
        starts.append(owned)
        prefix = tokenizer.decode(ids[:i + 1])
        if whole.startswith(prefix):
            owned = len(prefix)
    return starts


def test_byte_tokens_of_one_character_start_together(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the text has split characters
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    for token_id in ids:
        detokenizer.add_tokens([token_id])
    detokenizer.flush()
    assert detokenizer.output_text == TEXT
    assert detokenizer.token_starts == token_starts(tokenizer, ids)


@pytest.mark.parametrize("stop", ["Köln", "ö", "🚀", "lazy dog", "d the", "!"])
@pytest.mark.parametrize("step", [1, 3])
def test_entries_end_with_the_text_at_a_stop_string(tokenizer: Tokenizer, stop: str,
                                                    step: int) -> None:
    text, entries, _ = run(tokenizer, (stop,), step)
    cut = TEXT.index(stop)
    assert text == TEXT[:cut]
    ids = tokenizer.encode(TEXT)
    kept = [t for t, start in zip(ids, token_starts(tokenizer, ids), strict=True) if start < cut]
    assert [e.token_id for e in entries] == kept
    assert tokenizer.decode(kept).startswith(text)  # the kept tokens' text covers the answer
    assert len(kept) < len(ids)


def test_without_a_stop_every_entry_comes_out(tokenizer: Tokenizer) -> None:
    text, entries, _ = run(tokenizer, ())
    assert text == TEXT
    assert [e.token_id for e in entries] == tokenizer.encode(TEXT)


def test_held_back_text_holds_back_its_entries(tokenizer: Tokenizer) -> None:
    # While a stop string could still begin in the last characters, they are held back, and so
    # are the entries of the tokens that start there: an entry never precedes its text.
    stops = ("lazy dog.", "Köln 🚀 x")
    text, entries, per_output = run(tokenizer, stops)
    ids = tokenizer.encode(TEXT)
    starts = token_starts(tokenizer, ids)
    num_chars = num_entries = 0
    for delta, entries_out in per_output[:-1]:
        num_chars += len(delta)
        num_entries += len(entries_out)
        assert all(starts[i] < num_chars for i in range(num_entries))
        # ...and is not held longer than its text.
        assert all(starts[i] >= num_chars for i in range(num_entries, len(ids)))
    cut = TEXT.index("lazy dog.")
    assert text == TEXT[:cut]
    assert [e.token_id for e in entries] == [t for t, s in zip(ids, starts, strict=True)
                                             if s < cut]
