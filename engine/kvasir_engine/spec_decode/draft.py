"""`DraftProposer`: a small model (sharing the target's tokenizer) proposes k tokens greedily.

It keeps its own paged KV cache, as many blocks of the target's block size as the target has
(the runner sizes both from one budget), with its own block tables: per request, the leading
tokens whose draft K/V is valid (`num_computed`) and the blocks that hold them. Each call first
feeds every request's tokens it has not seen (its whole prompt the first time, afterwards the
tokens accepted since), takes the argmax as the first draft, then feeds each draft to get the
next, k forward passes in all. The drafts' own K/V is speculative and never counted as
computed: whatever the target accepts is fed again next time. A request the pool cannot hold
gets no drafts (never an error). Greedy drafts make the proposal one-hot, which is what
`rejection.py`'s rule needs to keep the target's distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvasir_engine.attention.metadata import build_attention_metadata, slot_mapping
from kvasir_engine.checkpoint.arch import ModelArch
from kvasir_engine.checkpoint.loader import load_weights
from kvasir_engine.checkpoint.metadata import read_model_arch
from kvasir_engine.config import EngineConfig
from kvasir_engine.kernels.choice import KernelChoice
from kvasir_engine.kv.block import KVCacheBlock
from kvasir_engine.kv.block_pool import BlockPool
from kvasir_engine.layers.dense import pack_model
from kvasir_engine.models.registry import model_class


def draft_block_bytes(config: EngineConfig, kv_dtype: torch.dtype) -> int:
    """K and V of one block over all the draft's layers (0 without a draft model)."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return 0
    arch = read_model_arch(spec.model)
    return (2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
            * kv_dtype.itemsize * config.cache.block_size)


@dataclass
class _DraftState:
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose draft K/V is valid

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


class DraftProposer:
    def __init__(self, config: EngineConfig, kernels: KernelChoice, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype, num_blocks: int) -> None:
        spec = config.speculative
        if spec is None or spec.model is None:
            raise ValueError("a draft proposer needs --speculative-config with a model")
        self.block_size = config.cache.block_size
        self.device = device
        self.arch: ModelArch = read_model_arch(spec.model)
        model = model_class(self.arch.architecture)(self.arch, kernels, 0, 1, None)
        load_weights(model, spec.model, self.arch)
        self.model = model.to(device=device, dtype=dtype).eval()
        if kernels.dense_matmul != "torch":  # the target's products, so the draft's too
            pack_model(self.model, kernels.dense_matmul)
        shape = (num_blocks, self.block_size, self.arch.num_key_value_heads, self.arch.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=device),
                           torch.zeros(shape, dtype=kv_dtype, device=device))
                          for _ in range(self.arch.num_hidden_layers)]
        # The engine's one block allocator, without a prefix cache (block 0: padding only).
        self.block_pool = BlockPool(num_blocks, enable_caching=False)
        self.states: dict[str, _DraftState] = {}

    def forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.block_pool.free_blocks(reversed(state.blocks))

    @torch.inference_mode()
    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        active = []
        for request_id, token_ids, num in requests:
            state = self.states.setdefault(request_id, _DraftState())
            # Positions written: every known token, then drafts 1..num-1.
            if num > 0 and self._reserve(state, len(token_ids) + num - 1):
                active.append((request_id, state, token_ids, num))
        if not active:
            return {}
        # Catch up on the tokens not yet seen; the last one's logits give the first draft.
        rows = [(state, token_ids[state.num_computed:], state.num_computed)
                for _, state, token_ids, _ in active]
        drafts = [[token] for token in self._greedy(rows)]
        for _, state, token_ids, _ in active:
            state.num_computed = len(token_ids)
        for step in range(1, max(num for *_, num in active)):
            going = [i for i, (*_, num) in enumerate(active) if num > step]
            rows = [(active[i][1], [drafts[i][-1]], len(active[i][2]) + step - 1) for i in going]
            for i, token in zip(going, self._greedy(rows), strict=True):
                drafts[i].append(token)
        return {request_id: drafts[i] for i, (request_id, *_) in enumerate(active)}

    def _reserve(self, state: _DraftState, num_positions: int) -> bool:
        needed = -(-num_positions // self.block_size) - len(state.blocks)
        if needed > self.block_pool.num_free_blocks:
            return False
        state.blocks += self.block_pool.get_new_blocks(max(needed, 0))
        return True

    def _greedy(self, rows: list[tuple[_DraftState, list[int], int]]) -> list[int]:
        """One forward over rows of (state, tokens, first position): each row's next argmax."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl, seq_lens = [0], []
        for state, tokens, start in rows:
            end = start + len(tokens)
            input_ids += tokens
            positions += range(start, end)
            slots += slot_mapping(state.block_ids, start, end, self.block_size)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
        meta = build_attention_metadata(slots, qsl, seq_lens, [s.block_ids for s, *_ in rows],
                                        self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, self.kv_caches, meta)  # [T, hidden]
        last = torch.tensor([end - 1 for end in qsl[1:]], dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[last])  # [R, vocab]
        next_tokens: list[int] = logits.argmax(dim=-1).tolist()
        return next_tokens
