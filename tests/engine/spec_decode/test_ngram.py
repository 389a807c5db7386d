"""N-gram (prompt lookup) proposals and the acceptance rule, against hand-worked cases."""

from __future__ import annotations

import pytest
from kvasir_engine.spec_decode.ngram import propose_ngram
from kvasir_engine.spec_decode.rejection import accepted_tokens


def test_the_latest_occurrence_of_the_longest_suffix_wins() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    # Suffix [1, 2] last occurred at 4 (followed by 4, 7); [7, 1, 2] never before.
    assert propose_ngram(tokens, 2, min_n=1, max_n=3) == [4, 7]
    # [9, 1, 2]-style longer matches win over shorter ones.
    assert propose_ngram([5, 6, 7, 8, 0, 6, 7, 1, 5, 6, 7], 2, min_n=2, max_n=3) == [8, 0]


def test_a_short_period_reads_on_into_its_own_proposal() -> None:
    assert propose_ngram([3, 4, 3, 4, 3], 5, min_n=1, max_n=2) == [4, 3, 4, 3, 4]
    assert propose_ngram([8, 8], 3, min_n=1, max_n=4) == [8, 8, 8]


def test_no_recurring_suffix_proposes_nothing() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, min_n=1, max_n=3) == []
    assert propose_ngram([1, 2, 1, 3], 3, min_n=2, max_n=3) == []  # [1, 3] is new
    assert propose_ngram([7], 3, min_n=1, max_n=3) == []


def test_acceptance_keeps_drafts_up_to_the_first_differing_draw() -> None:
    assert accepted_tokens([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all + bonus
    assert accepted_tokens([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # corrected at position 1
    assert accepted_tokens([4, 6, 7, 8], [5, 6, 7]) == [4]
    with pytest.raises(ValueError, match="need 3 draws"):
        accepted_tokens([1, 2], [1, 2])
