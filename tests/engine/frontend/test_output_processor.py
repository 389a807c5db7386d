"""Stop strings and streamed text deltas, over a real (tiny, trained) byte-level tokenizer."""

from __future__ import annotations

from helpers import CHAT_TEMPLATE
from kvasir_engine.core.outputs import EngineCoreOutput
from kvasir_engine.core.request import Request, SamplingParams
from kvasir_engine.frontend.output_processor import OutputProcessor
from kvasir_engine.tokenizer import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. Hello world! 🚀"


def run(tokenizer: Tokenizer, params: SamplingParams, text: str = TEXT,
        finish_at_end: str | None = "length"):  # type: ignore[no-untyped-def]
    processor = OutputProcessor(tokenizer)
    processor.add_request(Request("r", tokenizer.encode("Say:"), params))
    ids = tokenizer.encode(text)
    outputs, aborted = [], []
    for index, token_id in enumerate(ids):
        last = index == len(ids) - 1
        core = EngineCoreOutput("r", [token_id], finish_reason=finish_at_end if last else None)
        processed = processor.process_outputs([core])
        outputs += processed.request_outputs
        aborted += processed.stopped_req_ids
        if outputs and outputs[-1].finish_reason:
            break
    return outputs, aborted


def test_text_deltas_reassemble_the_text(tokenizer: Tokenizer) -> None:
    outputs, aborted = run(tokenizer, SamplingParams())
    assert "".join(o.text_delta for o in outputs) == TEXT
    assert outputs[-1].finish_reason == "length" and not aborted
    assert outputs[-1].num_output_tokens == len(tokenizer.encode(TEXT))


def test_stop_string_spanning_tokens_truncates_and_aborts(tokenizer: Tokenizer) -> None:
    stop = "lazy dog"
    assert len(tokenizer.encode(stop)) > 1
    outputs, aborted = run(tokenizer, SamplingParams(stop=("nowhere", stop)))
    text = "".join(o.text_delta for o in outputs)
    assert text == TEXT[: TEXT.index(stop)]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop
    assert aborted == ["r"]


def test_partial_stop_string_is_held_back_then_released(tokenizer: Tokenizer) -> None:
    outputs, _ = run(tokenizer, SamplingParams(stop=("over the lazy cat",)))
    streamed = [o.text_delta for o in outputs[:-1]]
    assert "".join(streamed) == TEXT[: len("".join(streamed))]
    # While "over the lazy " might still become the stop string, it is not streamed.
    assert len(TEXT) - len("".join(streamed)) >= 1
    assert "".join(o.text_delta for o in outputs) == TEXT
    assert outputs[-1].finish_reason == "length"


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    outputs, _ = run(tokenizer, SamplingParams(stop=("dog", "quick")))
    assert "".join(o.text_delta for o in outputs) == "The "
    assert outputs[-1].stop_reason == "quick"


def test_hf_dir_chat_template(tokenizer: Tokenizer) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.backend.token_to_id("<|im_start|>")
    assert tokenizer.eos_token_id == 2
