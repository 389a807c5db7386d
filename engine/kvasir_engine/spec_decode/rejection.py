"""The acceptance rule of speculative decoding, for deterministic (one-hot) proposals.

The standard rule (Leviathan et al. 2023; Chen et al. 2023) accepts draft token d at a position
with probability min(1, p(d) / q(d)), p the target's distribution there (after temperature,
top-k/p, min-p and penalties) and q the proposer's, and on rejection draws from
norm(max(0, p - q)). Both proposers here propose one token each position (q is one-hot: n-gram
lookup, and the draft model's greedy choice, as vLLM v1 does), so q(d) = 1: d is accepted with
probability p(d), and a rejection draws from p without d. That is exactly "draw x from p; accept
d when x == d, else emit x": x is d with probability p(d), and any other token t with
probability p(t). So the model runner draws each verified position with the plain sampler
(layers/sampler.py, the same seeded draw a step without speculation makes) and keeps the drafts
up to the first draw that differs; that draw is the corrected token, and when every draft is
accepted the last row's draw is the bonus token. The emitted tokens follow the target's
distribution exactly, and a seeded request emits the very tokens it would without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a verification emits: drafts up to the first one the target's draw at its
    position differs from, then that draw (or, all accepted, the draw after the last draft).

    `sampled[j]` is the target's draw at draft position j (len(drafts) + 1 of them).
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} draws, got {len(sampled)}")
    emitted: list[int] = []
    for draw, draft in zip(sampled, drafts, strict=False):
        emitted.append(draw)
        if draw != draft:
            return emitted
    emitted.append(sampled[-1])
    return emitted
