"""A fake executor for scheduler and engine-core tests: a paged KV cache of token ids.

It keeps per-request state the way the real model runner does (token ids, block table), writes
each computed token into its slot `(block_table[pos // block_size], pos % block_size)` of a fake
cache, and "samples" a deterministic function of the tokens it reads back from that cache. So a
wrong block table, a prefix hit on the wrong block, or a shared block overwritten all change the
output, which the tests compare with `reference_continuation`.

With a `propose` function it also speculates as the real runner does: it "verifies" the drafts
the scheduler sends (each draft position's token is the model's next token given the tokens
before it, drafts included), emits the accepted drafts and one token more, and proposes the next
drafts for the requests the scheduler names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvasir_engine.config import RuntimeInfo
from kvasir_engine.core.executor_protocol import WholeForward
from kvasir_engine.core.outputs import ModelRunnerOutput, SchedulerOutput

VOCAB_SIZE = 1000
EOS_TOKEN_ID = 999


def hash_next_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends on every token before it."""
    acc = len(token_ids)
    for token_id in token_ids:
        acc = (acc * 1_000_003 + token_id) % 2_147_483_647
    return acc % (VOCAB_SIZE - 1)  # never EOS unless a test's model says so


def reference_continuation(prompt: list[int], max_tokens: int,
                           next_token: Callable[[list[int]], int] = hash_next_token,
                           eos_token_id: int | None = None) -> list[int]:
    token_ids = list(prompt)
    outputs: list[int] = []
    while len(outputs) < max_tokens:
        outputs.append(next_token(token_ids))
        token_ids.append(outputs[-1])
        if outputs[-1] == eos_token_id:
            break
    return outputs


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeExecutor:
    num_kv_blocks: int
    block_size: int
    next_token: Callable[[list[int]], int] = hash_next_token
    eos_token_ids: frozenset[int] = frozenset({EOS_TOKEN_ID})
    requests: dict[str, _RunnerRequest] = field(default_factory=dict)
    # (block_id, slot) -> (position, token id) of the K/V "stored" there.
    kv_cache: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    history: list[SchedulerOutput] = field(default_factory=list)
    is_shut_down: bool = False
    # (token ids so far, drafts wanted) -> drafts; None = no speculation.
    propose: Callable[[list[int], int], list[int]] | None = None

    def initialize(self) -> RuntimeInfo:
        return RuntimeInfo(num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
                           eos_token_ids=self.eos_token_ids, device="cpu",
                           kv_cache_bytes=self.num_kv_blocks * self.block_size)

    def start_model(self, scheduler_output: SchedulerOutput) -> WholeForward:
        return WholeForward(lambda: self.execute_model(scheduler_output))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert not scheduler_output.is_empty, "the core must not execute an empty plan"
        self.history.append(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            assert new.request_id not in self.requests
            self.requests[new.request_id] = _RunnerRequest(list(new.token_ids),
                                                           list(new.block_ids),
                                                           new.num_computed_tokens)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            if cached.num_kept_blocks is not None:
                assert cached.num_kept_blocks <= len(state.block_ids)
                del state.block_ids[cached.num_kept_blocks:]
            state.block_ids.extend(cached.new_block_ids)
        # Store every scheduled token's K/V first, then "attend", as the attention backend does.
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            assert 0 not in state.block_ids, "block 0 is the null block"
            end = state.num_computed_tokens + num_tokens
            drafts = scheduler_output.scheduled_spec_token_ids.get(req_id, [])
            token_ids = state.token_ids + drafts
            assert not drafts or state.num_computed_tokens == len(state.token_ids) - 1
            assert end <= len(token_ids)
            assert len(state.block_ids) * self.block_size >= end
            for pos in range(state.num_computed_tokens, end):
                self.kv_cache[self._slot(state, pos)] = (pos, token_ids[pos])
        req_ids, sampled = [], []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            drafts = scheduler_output.scheduled_spec_token_ids.get(req_id, [])
            state.num_computed_tokens += num_tokens
            req_ids.append(req_id)
            if state.num_computed_tokens < len(state.token_ids) + len(drafts):
                sampled.append([])
                continue
            seen = [self.kv_cache[self._slot(state, pos)]
                    for pos in range(state.num_computed_tokens)]
            assert [pos for pos, _ in seen] == list(range(len(seen))), "K/V from another place"
            seen_ids = [token for _, token in seen]
            emitted = []
            for j in range(len(drafts) + 1):  # the draws at each draft position
                emitted.append(self.next_token(seen_ids[:len(seen_ids) - len(drafts) + j]))
                if j == len(drafts) or emitted[-1] != drafts[j]:
                    break
            state.token_ids += emitted
            state.num_computed_tokens -= len(drafts) + 1 - len(emitted)
            sampled.append(emitted)
        spec: list[list[int]] = []
        if self.propose is not None and scheduler_output.num_spec_tokens_to_propose:
            wanted = scheduler_output.num_spec_tokens_to_propose
            spec = [self.propose(self.requests[r].token_ids, wanted[r]) if r in wanted else []
                    for r in req_ids]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 logprobs=[None] * len(req_ids), spec_token_ids=spec)

    def shutdown(self) -> None:
        self.is_shut_down = True

    def _slot(self, state: _RunnerRequest, pos: int) -> tuple[int, int]:
        return state.block_ids[pos // self.block_size], pos % self.block_size
