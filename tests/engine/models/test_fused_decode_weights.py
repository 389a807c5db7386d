"""The fused decode path's weights are bound by name (models/fused_decode.py): each layer's
tensors are looked up by module name into `FusedLayerWeights`, and `kernel_weights` alone lays
them out in cpu_decode.cpp's positional order; a missing, renamed or wrongly quantized weight
is a ValueError naming it. Layouts only: no native kernel runs here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import write_checkpoint
from kvasir_engine.checkpoint.metadata import read_model_arch
from kvasir_engine.kernels.choice import KernelChoice
from kvasir_engine.layers.quantization import quantize_int4, quantize_model
from kvasir_engine.models.fused_decode import FusedLayerWeights, kernel_weights
from kvasir_engine.models.llama import LlamaForCausalLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")  # with q/k/v biases


def _model(checkpoint: Path, method: str = "int8", native: bool = True) -> LlamaForCausalLM:
    model = LlamaForCausalLM(read_model_arch(checkpoint), KernelChoice())
    quantize_model(model, method, torch.float32, native=native)
    return model


def _layers(model: LlamaForCausalLM) -> list[FusedLayerWeights]:
    return [FusedLayerWeights.from_layer(layer, i) for i, layer in enumerate(model.model.layers)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_positional_list_follows_the_names(checkpoint: Path, method: str) -> None:
    model = _model(checkpoint, method)
    found, weights = kernel_weights(_layers(model), model.model.norm.weight)
    per_linear = 3 if method == "int4" else 2
    per_layer = 3 + 4 * per_linear
    assert found == method and len(weights) == len(model.model.layers) * per_layer + 1
    last = model.model.layers[-1]
    base = (len(model.model.layers) - 1) * per_layer
    assert weights[base] is last.input_layernorm.weight
    assert weights[base + 1] is last.post_attention_layernorm.weight
    assert weights[base + 2] is last.self_attn.qkv_proj.bias
    first_tensor = "packed" if method == "int4" else "rows"
    linears = (last.self_attn.qkv_proj, last.self_attn.o_proj, last.mlp.gate_up_proj,
               last.mlp.down_proj)
    for i, linear in enumerate(linears):
        assert weights[base + 3 + i * per_linear] is getattr(linear.quantized, first_tensor)
    assert weights[-1] is model.model.norm.weight


def test_a_renamed_module_is_named_in_the_error(checkpoint: Path) -> None:
    model = _model(checkpoint)
    mlp = model.model.layers[1].mlp
    mlp.down = mlp.down_proj
    del mlp.down_proj
    with pytest.raises(ValueError, match="decoder layer 1 has no module 'mlp.down_proj'"):
        _layers(model)


def test_unquantized_fallback_or_mixed_linears_are_refused(checkpoint: Path) -> None:
    model = _model(checkpoint)
    model.model.layers[0].self_attn.o_proj.quantized = None
    with pytest.raises(ValueError,
                       match="layer 0's self_attn.o_proj is neither quantized nor packed"):
        _layers(model)
    fallback = _model(checkpoint, native=False)
    with pytest.raises(ValueError, match="layer 0's qkv_proj is quantized for the torch fallback"):
        kernel_weights(_layers(fallback), fallback.model.norm.weight)
    mixed = _model(checkpoint)
    down = mixed.model.layers[0].mlp.down_proj
    down.quantized = quantize_int4(torch.randn(down.quantized.rows.shape[0],
                                               down.quantized.in_features), native=True)
    with pytest.raises(ValueError, match="one weight form for every linear"):
        kernel_weights(_layers(mixed), mixed.model.norm.weight)
