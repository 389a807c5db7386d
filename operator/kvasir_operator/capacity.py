"""Capacity check before any GPU is spent: do the weights plus one full-length sequence fit?

    usable      = num_gpus x gpu_memory x gpuMemoryUtilization
    kv_per_tok  = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes
    kv_budget   = usable - weights
    sequences   = floor(kv_budget / (kv_per_tok x maxModelLen))

The KV heads are sharded over the TP ranks like the weights, so summing over the pod's GPUs is
exact up to per-rank rounding; pipeline stages split the layers (weights and KV alike) over the
pods of one replica, so num_gpus counts every pod of it (gpus x pipelineParallelSize).
Activations and CUDA graphs live in the (1 - utilization) margin,
as in vLLM's profiling. Weights bytes are file sizes, so a pre-quantized checkpoint's bytes per
weight are the checkpoint's own, whatever spec.engine.quantization says. Two exceptions, read
from config.json's quantization_config: an integer-quantized checkpoint (W4A16, W8A8, GPTQ,
AWQ) runs on the engine's CPU tiles only, so on GPUs it does not fit at all; an FP8 one stays
FP8 on GPUs with FP8 products (compute capability 8.9 and later) and is dequantized to 16 bits
elsewhere, so its weights count twice there (an upper bound: its embeddings are 16-bit anyway).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvasir_operator.spec import Architecture, InferenceServiceSpec

GIB = 1 << 30
# Memory per GPU, by the model names the NVIDIA/AMD device plugins publish (upper case, dashes).
GPU_MEMORY_BYTES = {
    "B200": 180 * GIB, "H200": 141 * 10**9, "H100-80GB": 80 * GIB, "H100-NVL": 94 * GIB,
    "H100": 80 * GIB, "H800": 80 * GIB, "GH200": 96 * GIB, "A100-80GB": 80 * GIB,
    "A100-40GB": 40 * GIB, "A100": 40 * GIB, "A800": 80 * GIB, "L40S": 48 * GIB, "L40": 48 * GIB,
    "L4": 24 * GIB, "A10G": 24 * GIB, "A10": 24 * GIB, "A30": 24 * GIB, "A40": 48 * GIB,
    "T4": 16 * GIB, "V100-32GB": 32 * GIB, "V100": 16 * GIB, "RTX-4090": 24 * GIB,
    "RTX-6000-ADA": 48 * GIB, "MI300X": 192 * GIB, "MI250X": 128 * GIB,
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
# GPUs without FP8 products (compute capability below 8.9), by the names above: an FP8
# checkpoint's weights are dequantized to 16 bits there. Unknown names are given the benefit.
NO_FP8_GPUS = ("A100", "A800", "A10", "A30", "A40", "T4", "V100")


def gpu_model(gpu_type: str) -> str | None:
    """Longest table key contained in the name: 'NVIDIA-H100-80GB-HBM3' -> H100-80GB."""
    name = gpu_type.upper().replace(" ", "-").replace("_", "-")
    matches = [key for key in GPU_MEMORY_BYTES if key in name]
    return max(matches, key=len) if matches else None


def gpu_memory_bytes(gpu_type: str) -> int | None:
    model = gpu_model(gpu_type)
    return None if model is None else GPU_MEMORY_BYTES[model]


@dataclass(frozen=True)
class CapacityReport:
    weights_bytes: int
    kv_bytes_per_token: int  # all layers, K and V, whole model (summed over TP ranks)
    gpu_memory_bytes: int  # one GPU
    num_gpus: int
    usable_bytes: int
    kv_budget_bytes: int
    max_model_len: int | None
    num_sequences_fit: int | None  # full maxModelLen sequences; None without maxModelLen
    fits: bool
    message: str

    def to_status(self) -> dict[str, Any]:
        camel = {"weights_bytes": "weightsBytes", "kv_bytes_per_token": "kvBytesPerToken",
                 "gpu_memory_bytes": "gpuMemoryBytes", "num_gpus": "gpus",
                 "usable_bytes": "usableBytes", "kv_budget_bytes": "kvBudgetBytes",
                 "max_model_len": "maxModelLen", "num_sequences_fit": "sequencesFit",
                 "fits": "fits", "message": "message"}
        return {camel[k]: v for k, v in asdict(self).items() if v is not None}


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_capacity(spec: InferenceServiceSpec, weights_bytes: int,
                   arch: Architecture | None) -> CapacityReport | None:
    """None when it cannot be judged: CPU pods, or no GPU memory figure, or no model shape."""
    r, e = spec.resources, spec.engine
    per_gpu = r.gpu_memory_bytes or (gpu_memory_bytes(r.gpu_type) if r.gpu_type else None)
    num_gpus = r.num_gpus * spec.num_nodes
    if num_gpus == 0 or per_gpu is None or arch is None:
        return None
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * DTYPE_BYTES[e.dtype]
    usable = int(num_gpus * per_gpu * e.gpu_memory_utilization)
    quant, weights_note = arch.quantization, ""
    if quant is not None and quant.weight_type == "int":
        return CapacityReport(weights_bytes, kv_per_token, per_gpu, num_gpus, usable, 0,
                              e.max_model_len, 0, False,
                              f"the checkpoint is {quant.describe()} (config.json's "
                              "quantization_config): Kvasir runs integer-quantized checkpoints "
                              "on CPU engines only; set spec.resources.gpus to 0")
    model = gpu_model(r.gpu_type) if r.gpu_type else None
    if (quant is not None and quant.weight_type == "float" and model is not None
            and model.split("-")[0] in NO_FP8_GPUS):
        weights_bytes *= 2
        weights_note = f" (FP8 checkpoint dequantized to 16 bits on {r.gpu_type})"
    budget = usable - weights_bytes
    head = (f"{num_gpus} x {_gib(per_gpu)} x {e.gpu_memory_utilization} = {_gib(usable)} "
            f"usable; weights {_gib(weights_bytes)}{weights_note}; KV cache 2 x "
            f"{arch.num_layers} layers x "
            f"{arch.num_kv_heads} KV heads x {arch.head_dim} head dim x {DTYPE_BYTES[e.dtype]} B "
            f"= {kv_per_token} B/token")
    if budget <= 0:
        return CapacityReport(weights_bytes, kv_per_token, per_gpu, num_gpus, usable, budget,
                              e.max_model_len, 0, False,
                              f"weights do not fit: {head}; {_gib(budget)} left for the KV cache")
    if e.max_model_len is None:
        tokens = budget // kv_per_token
        return CapacityReport(weights_bytes, kv_per_token, per_gpu, num_gpus, usable, budget,
                              None, None, True, f"{head}; room for {tokens} tokens of KV cache")
    per_seq = kv_per_token * e.max_model_len
    num_fit = math.floor(budget / per_seq)
    verdict = "fits" if num_fit >= 1 else "does not fit"
    message = (f"{verdict}: {head}; {_gib(budget)} for KV / ({kv_per_token} B x "
               f"{e.max_model_len} tokens = {_gib(per_seq)} per sequence) = {num_fit} sequences")
    return CapacityReport(weights_bytes, kv_per_token, per_gpu, num_gpus, usable, budget,
                          e.max_model_len, num_fit, num_fit >= 1, message)
