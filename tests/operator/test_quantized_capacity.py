"""Pre-quantized checkpoints in the operator: spec.engine.quantization's format names, the
quantization_config read from config.json, and what the capacity check makes of it (bytes per
weight are the checkpoint's files'; integer schemes are refused on GPUs, FP8 counts twice on
GPUs without FP8 products)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvasir_operator.capacity import check_capacity
from kvasir_operator.modelconfig import parse_config
from kvasir_operator.spec import Architecture, CheckpointQuantization, SpecError
from kvasir_operator.spec_parse import parse_spec

LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                   "strategy": "group", "group_size": 128}}}}
FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                   "strategy": "channel"}}}}


@pytest.mark.parametrize("quantization_config,expected", [
    (None, None),
    (W4A16, CheckpointQuantization("compressed-tensors", "int", 4)),
    (FP8, CheckpointQuantization("compressed-tensors", "float", 8)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, CheckpointQuantization("gptq", "int", 4)),
    ({"quant_method": "awq", "w_bit": 4}, CheckpointQuantization("awq", "int", 4)),
    ("not an object", None),
])
def test_config_json_says_what_its_weights_are(quantization_config: Any,
                                               expected: CheckpointQuantization | None) -> None:
    config = dict(LLAMA) if quantization_config is None else {
        **LLAMA, "quantization_config": quantization_config}
    assert parse_config(json.dumps(config).encode()).quantization == expected


def _spec(gpu_type: str, **engine: Any):  # type: ignore[no-untyped-def]
    return parse_spec("m", {"model": {"uri": "s3://bkt/m"},
                            "engine": {"maxModelLen": 8192, **engine},
                            "resources": {"gpus": 1, "gpuType": gpu_type}})


def test_integer_checkpoints_do_not_fit_any_gpu() -> None:
    arch = parse_config(json.dumps({**LLAMA, "quantization_config": W4A16}).encode())
    report = check_capacity(_spec("H100"), 5 * 10**9, arch)
    assert report is not None and not report.fits
    assert report.message.startswith("the checkpoint is compressed-tensors INT4 (config.json's "
                                     "quantization_config): Kvasir runs integer-quantized "
                                     "checkpoints on CPU engines only")


def test_fp8_weights_count_once_where_gpus_multiply_fp8_and_twice_elsewhere() -> None:
    shape = Architecture(num_layers=32, num_kv_heads=8, head_dim=128)
    fp8 = Architecture(32, 8, 128, quantization=CheckpointQuantization(
        "compressed-tensors", "float", 8))
    weights = 8 * 10**9
    plain = check_capacity(_spec("H100"), weights, shape)
    hopper = check_capacity(_spec("H100", quantization="compressed-tensors"), weights, fp8)
    ampere = check_capacity(_spec("A100-80GB", quantization="fp8"), weights, fp8)
    assert plain is not None and hopper is not None and ampere is not None
    assert hopper.weights_bytes == plain.weights_bytes == weights
    assert ampere.weights_bytes == 2 * weights
    assert "(FP8 checkpoint dequantized to 16 bits on A100-80GB)" in ampere.message
    assert hopper.kv_budget_bytes > ampere.kv_budget_bytes


@pytest.mark.parametrize("quantization", ["compressed-tensors", "fp8"])
def test_checkpoint_formats_that_may_be_fp8_are_allowed_on_gpus(quantization: str) -> None:
    spec = _spec("H100", quantization=quantization, tensorParallelSize=1)
    assert spec.engine.quantization == quantization


@pytest.mark.parametrize("quantization", ["gptq", "awq", "int4"])
def test_cpu_only_quantizations_are_refused_on_gpus(quantization: str) -> None:
    with pytest.raises(SpecError, match=f"spec.engine.quantization \\({quantization}\\) runs on "
                                        "CPU engines only"):
        _spec("H100", quantization=quantization)
