"""`Proposer`: what the model runner asks of either proposer, and `make_proposer`."""

from __future__ import annotations

from typing import Protocol

from kvasir_engine.config import EngineConfig, SpeculativeConfig
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


def make_proposer(config: EngineConfig, num_kv_blocks: int) -> Proposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    raise ValueError(f"--speculative-config: method {spec.method} is not available yet")
