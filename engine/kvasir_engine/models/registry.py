"""Architecture name (config.json `architectures`) -> the model class that serves it.

Every family today is served by `LlamaForCausalLM`; a second family widens the return type to a
Protocol of what the runner calls (forward, `compute_logits`, `enable_fused_decode`)."""

from __future__ import annotations

from kvasir_engine.models.llama import LlamaForCausalLM

ARCHITECTURE_TO_MODEL: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in ARCHITECTURE_TO_MODEL:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(ARCHITECTURE_TO_MODEL))}")
    return ARCHITECTURE_TO_MODEL[architecture]
