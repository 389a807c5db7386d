"""`PipelineStage`: which part of the model one pipeline-parallel stage owns.

Stage `pp_rank` of `pp_size` owns the contiguous decoder layers `[start_layer, end_layer)`; the
first stage also owns the token embedding, the last the final norm and the LM head. The split
balances compute rather than layer count: the LM head costs about `vocab x hidden` multiply-adds
per sampled token, which for a small model is several layers' worth (SmolLM2-135M: 49,152 x 576
= 28M, eight of its 3.5M-parameter layers), so the last stage gets that many fewer layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvasir_engine.checkpoint.arch import ModelArch

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    pp_rank: int
    pp_size: int
    start_layer: int
    end_layer: int  # exclusive
    # The LM head is the embedding's weight: a last stage without the embedding loads it too.
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in [0, {self.pp_size}), got {self.pp_rank}")
        if not 0 <= self.start_layer < self.end_layer:
            raise ValueError(f"stage {self.pp_rank} owns no layers "
                             f"([{self.start_layer}, {self.end_layer}))")

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def owns_layer(self, index: int) -> bool:
        return self.start_layer <= index < self.end_layer

    def owns_weight(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` (Hugging Face naming) is loaded on this stage."""
        match = _LAYER_NAME.match(name)
        if match:
            return self.owns_layer(int(match.group(1)))
        if name.startswith("model.embed_tokens."):
            return self.is_first or (self.is_last and self.tie_word_embeddings)
        return self.is_last  # model.norm, lm_head


def whole_model(arch: ModelArch) -> PipelineStage:
    return PipelineStage(0, 1, 0, arch.num_hidden_layers, arch.tie_word_embeddings)


def head_cost_in_layers(arch: ModelArch) -> float:
    """The LM head's multiply-adds per sampled token, in decoder layers."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate_size
    return arch.vocab_size * h / per_layer


def split_layers(num_layers: int, pp_size: int, head_cost: float = 0.0) -> list[tuple[int, int]]:
    """[start, end) of each stage: equal shares of `num_layers + head_cost`, the head on the
    last stage, every stage at least one layer."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp_size} exceeds the model's {num_layers} "
                         f"layers (every stage needs at least one)")
    total = num_layers + head_cost
    bounds = [0]
    for k in range(1, pp_size):
        b = round(k * total / pp_size)
        bounds.append(min(max(b, bounds[-1] + 1), num_layers - (pp_size - k)))
    bounds.append(num_layers)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def stage_for(arch: ModelArch, pp_rank: int, pp_size: int) -> PipelineStage:
    start, end = split_layers(arch.num_hidden_layers, pp_size, head_cost_in_layers(arch))[pp_rank]
    return PipelineStage(pp_rank, pp_size, start, end, arch.tie_word_embeddings)
