"""`--batch-invariant` on the default model (SmolLM2-135M, bfloat16): a 49-token prompt (three
blocks and one token) gives the same greedy tokens and logprobs, bit for bit, alone, beside
five neighbours of other lengths arriving at other steps under a 32-token step budget, and
again once its three blocks are cached (its last token then computed alone over them)."""

from __future__ import annotations

import random

from helpers import default_gguf_path
from test_batch_invariant import engine_for, run


def test_default_model_alone_batched_chunked_and_cached() -> None:
    rng = random.Random(9)
    subject = [rng.randrange(1000, 40000) for _ in range(49)]
    neighbours = [[rng.randrange(1000, 40000) for _ in range(rng.randint(1, 60))]
                  for _ in range(5)]
    alone = run(engine_for(default_gguf_path(), "--batch-invariant",
                           "--no-enable-prefix-caching"), [(0, "subject", subject)])["subject"]
    engine = engine_for(default_gguf_path(), "--batch-invariant",
                        "--max-num-batched-tokens", "32")
    arrivals = [(rng.randint(0, 4), f"n{i}", p) for i, p in enumerate(neighbours)]
    batch = run(engine, [*arrivals, (2, "subject", subject)])["subject"]
    again = run(engine, [(0, "subject", subject), *[(s, f"m{r}", p) for s, r, p in arrivals]])
    assert again["subject"].num_cached_tokens == 48
    for answer in (batch, again["subject"]):
        assert answer.tokens == alone.tokens
        assert answer.logprobs == alone.logprobs
