"""Architecture name (config.json `architectures`) -> the model class that serves it."""

from __future__ import annotations

from torch import nn

from kvasir_engine.models.llama import LlamaForCausalLM

ARCHITECTURE_TO_MODEL: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in ARCHITECTURE_TO_MODEL:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(ARCHITECTURE_TO_MODEL))}")
    return ARCHITECTURE_TO_MODEL[architecture]
