"""The logprobs shapes of token_text.py, on a tokenizer whose texts we choose (collisions too)."""

from __future__ import annotations

from kvasir_engine.core.request import LogprobsEntry
from kvasir_engine.server.token_text import completion_logprobs, echo_logprobs, prompt_logprobs

TEXTS = {0: "a", 1: "b", 2: "\ufffd", 3: "\ufffd", 4: "cc"}


class Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(TEXTS[i] for i in ids)


def test_the_sampled_token_joins_the_top_when_outside_it() -> None:
    e = LogprobsEntry(4, -3.0, (0, 1), (-0.5, -1.0))
    out = completion_logprobs(Tokenizer(), [e], num_top=1)
    assert out.top_logprobs == [{"a": -0.5, "cc": -3.0}]  # logprobs + 1 entries
    assert out.tokens == ["cc"] and out.token_logprobs == [-3.0]
    inside = completion_logprobs(Tokenizer(), [LogprobsEntry(0, -0.5, (0, 1), (-0.5, -1.0))],
                                 num_top=2)
    assert inside.top_logprobs == [{"a": -0.5, "b": -1.0}]


def test_equal_texts_keep_the_likelier_value_so_greedy_reads_right() -> None:
    # Token 3 was sampled, token 2 (same text) is the argmax: lm-eval's is_greedy must be False.
    e = LogprobsEntry(3, -2.0, (2,), (-0.1,))
    (top,) = completion_logprobs(Tokenizer(), [e], num_top=1).top_logprobs
    assert top == {"\ufffd": -0.1} and -2.0 != max(top.values())


def test_echo_part_starts_with_a_null_and_counts_offsets() -> None:
    entries = [LogprobsEntry(1, -1.5, (0,), (-0.2,)), LogprobsEntry(4, -0.3, (4,), (-0.3,))]
    out = echo_logprobs(Tokenizer(), [0, 1, 4], entries, 1)
    assert out.tokens == ["a", "b", "cc"]
    assert out.token_logprobs == [None, -1.5, -0.3]
    assert out.top_logprobs == [None, {"a": -0.2, "b": -1.5}, {"cc": -0.3}]
    assert out.text_offset == [0, 1, 2]
    unknown = echo_logprobs(Tokenizer(), [0, 1], None, 1)  # aborted before its prefill ended
    assert unknown.token_logprobs == [None, None] and unknown.text_offset == [0, 1]


def test_vllm_prompt_logprobs_are_keyed_by_token_id_with_ranks() -> None:
    entries = [LogprobsEntry(3, -2.0, (2, 3), (-0.1, -2.0), rank=2)]
    (first, position) = prompt_logprobs(Tokenizer(), entries, 1)  # type: ignore[misc]
    assert first is None
    assert {k: (v.logprob, v.rank, v.decoded_token) for k, v in position.items()} == {
        "3": (-2.0, 2, "\ufffd"), "2": (-0.1, 1, "\ufffd")}
    assert prompt_logprobs(Tokenizer(), None, 1) is None
