"""`ModelArch`: the hyperparameters of a Llama-family decoder, read from a checkpoint.

Ground-floor data: it imports nothing of the engine (and no torch), so `config.py`,
`layers/rotary.py` and `models/` can all use it. Readers for a Hugging Face `config.json` and for
GGUF metadata live in `checkpoint/metadata.py`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style ("llama3") or linear RoPE scaling; `rope_type == "default"` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    architecture: str  # e.g. "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    # Qwen2 has biases on q/k/v projections; Llama and Mistral have none.
    attention_bias: bool = False
    # Mistral's sliding window; None = full attention. (Served as full attention within max_model_len.)
    sliding_window: int | None = None
    # The checkpoint's own dtype ("float32", "bfloat16", "float16"); GGUF reports "float32".
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def num_params(self) -> int:
        """Parameter count, for memory sizing and roofline napkin maths."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
