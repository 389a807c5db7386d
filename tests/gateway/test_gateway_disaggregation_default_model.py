"""Issue 33's acceptance on the default model (SmolLM2-135M): greedy output through the gateway
is token-identical with disaggregation on (a producer engine process, a consumer engine server)
and off, in float32 and bfloat16, one request alone and 16 concurrent streams.

The references are test_gateway_disaggregation_engines.py's: the consumer's own answer, cold
and then with the prompt's prefix in its cache (`--disaggregation never`), one request at a
time; a disaggregated answer equals the cached one (the consumer computes the last prompt token
over received blocks, as over cached ones), and under float32 the cold one too. In bfloat16 a
request's greedy text also depends on the batch around it (16 streams at once against one
request at a time: one of the 16 differed, with disaggregation as without), so the bfloat16
pair runs `--batch-invariant` (docs/batch_invariance.md) and every answer must equal the cold
one.
"""

from __future__ import annotations

import concurrent.futures
import random
from pathlib import Path

import pytest

pytest.importorskip("torch")
from gateway_support import disaggregation_counts  # noqa: E402
from helpers import default_gguf_path  # noqa: E402
from test_gateway_disaggregation_engines import (  # noqa: E402
    complete,
    engine_pair,
    gateway_for,
    num_blocks,
)

STREAMS = 16
_rng = random.Random(33)
# 16 prompts of 24 to 69 token ids of the model's vocabulary (49,152), each its own.
PROMPTS = [[_rng.randrange(1000, 40000) for _ in range(24 + 3 * i)] for i in range(STREAMS)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_greedy_output_is_the_same_with_and_without_disaggregation(
        tmp_path: Path, dtype: str) -> None:
    invariant = dtype == "bfloat16"
    with engine_pair(default_gguf_path(), tmp_path, dtype, kv_mib=160,
                     batch_invariant=invariant) as pair:
        with gateway_for(pair, "never") as url:
            cold = [complete(url, p, "local")["text"] for p in PROMPTS]
            cached = [complete(url, p, "local")["text"] for p in PROMPTS]
        assert pair.received_blocks() == 0
        assert cached == cold
        with gateway_for(pair, "always") as url:
            assert complete(url, PROMPTS[0], "alone")["text"] == cached[0]
            with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
                streamed = list(pool.map(lambda p: complete(url, p, "streams", stream=True),
                                         PROMPTS))
            assert [s["text"] for s in streamed] == cached
            assert disaggregation_counts(url) == {("remote", "prefill"): 1.0 + STREAMS}
        assert pair.received_blocks() == sum(map(num_blocks, [PROMPTS[0], *PROMPTS]))
