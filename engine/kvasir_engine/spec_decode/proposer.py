"""`Proposer`: what the model runner asks of either proposer, and `make_proposer`."""

from __future__ import annotations

from typing import Protocol

import torch

from kvasir_engine.config import EngineConfig, SpeculativeConfig
from kvasir_engine.kernels.choice import KernelChoice
from kvasir_engine.spec_decode.ngram import propose_ngram


class Proposer(Protocol):
    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """{request_id: drafts} for (request_id, every known token, drafts wanted) triples;
        a request may get fewer drafts than wanted, or none."""
        ...

    def forget(self, request_ids: set[str]) -> None:
        """Requests finished or preempted: drop whatever is kept for them."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for request_id, token_ids, num_tokens in requests:
            drafts = propose_ngram(token_ids, num_tokens, self.config.prompt_lookup_min,
                                   self.config.prompt_lookup_max)
            if drafts:
                out[request_id] = drafts
        return out

    def forget(self, request_ids: set[str]) -> None:
        pass


def make_proposer(config: EngineConfig, kernels: KernelChoice, device: torch.device,
                  dtype: torch.dtype, kv_dtype: torch.dtype,
                  num_kv_blocks: int) -> Proposer | None:
    """The proposer of `--speculative-config` (None without one); a draft model gets as many
    KV blocks as the target (`draft.draft_block_bytes` is in the runner's sizing)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    from kvasir_engine.spec_decode.draft import DraftProposer

    return DraftProposer(config, kernels, device, dtype, kv_dtype, num_kv_blocks)
