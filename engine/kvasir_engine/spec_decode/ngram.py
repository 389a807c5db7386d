"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.

Free of torch and of any model: it pays on text that repeats its context (code edits,
extraction, summaries quoting the prompt, structured output) and proposes nothing on text that
does not. Proposals are deterministic (a one-hot draft distribution), which is what makes
`rejection.py`'s rule exact.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` draft tokens continuing `token_ids`; [] when no suffix recurs.

    The continuation is read on from the match into the proposal itself when it reaches the
    end of the sequence, so a period shorter than `num_tokens` still yields a full draft
    (`a b a b` proposes `a b a b ...`).
    """
    num = len(token_ids)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = list(token_ids[num - n:])
        first = suffix[0]
        for start in range(num - n - 1, -1, -1):  # the latest earlier occurrence first
            if token_ids[start] == first and list(token_ids[start:start + n]) == suffix:
                return _continuation(token_ids, start + n, num_tokens)
    return []


def _continuation(token_ids: Sequence[int], begin: int, num_tokens: int) -> list[int]:
    proposed: list[int] = []
    num = len(token_ids)
    for pos in range(begin, begin + num_tokens):
        proposed.append(token_ids[pos] if pos < num else proposed[pos - num])
    return proposed
