"""`CheckpointQuantization`: what a pre-quantized Hugging Face checkpoint says it is.

Most quantized models users download for vLLM carry a `quantization_config` in `config.json`:
compressed-tensors (llm-compressor's W4A16 "pack-quantized", W8A16 / W8A8 int8, FP8) or the
older AutoGPTQ / AutoAWQ layouts. This module reads that block into one frozen value, torch-free,
so `args.py` can check `--quantization` against it and the operator's sizing can mirror it
before anything loads. What it cannot run fails here with one line naming the scheme.

Which of our kernels runs each scheme (docs/quantization.md):
- int4 weights, groups a multiple of 32 or one per channel, symmetric or with zero points
  (always weight-only: W4A16, GPTQ, AWQ) -> the native weight-only int4 kernel (groups of 32,
  `weight = scale * code + minimum`, the library's dequantized weights exactly) times float
  activations;
- int8 weights, symmetric, one scale per channel or tensor: weight-only (W8A16) -> the native
  weight-only int8 kernel, float activations; with dynamic per-token int8 activations (W8A8)
  -> the native int8 tile (per-row int8 activations, the scheme's);
- FP8 (e4m3) weights -> dequantized at load to the compute dtype on CPU.
`kernel` names the weights' form ("int4" / "int8", also what `--quantization` must agree with);
`activation_bits` None is what sends a layer to the weight-only kernels (layers/prequantized.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Kernel names a checkpoint maps onto; the first two are also `--quantization` values.
KERNEL_INT4, KERNEL_INT8, KERNEL_FP8 = "int4", "int8", "fp8"
COMPRESSED_TENSORS = "compressed-tensors"
# A Llama decoder layer's Linears, by their Hugging Face names.
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# compressed-tensors' storage formats we read; the packed int4 one and the two int8 ones.
_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class CheckpointQuantization:
    quant_method: str  # "compressed-tensors" | "gptq" | "awq"
    weight_type: str  # "int" | "float"
    bits: int  # bits a weight: 4 or 8
    # Weights per scale along the input features; None: one scale per output channel.
    group_size: int | None
    symmetric: bool  # False: a zero point per group
    storage: str  # compressed-tensors' format ("pack-quantized", ...), or "gptq" / "awq"
    # 8: activations quantized per token at run time (W8A8, FP8 dynamic); None: weight-only.
    activation_bits: int | None = None
    act_order: bool = False  # GPTQ desc_act: columns assigned to groups by a g_idx
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors' module patterns
    ignore: tuple[str, ...] = ("lm_head",)  # modules left unquantized

    @property
    def kernel(self) -> str:
        """What runs it: "int4" | "int8" (the native CPU kernels: weight-only ones unless
        `activation_bits`) | "fp8" (dequantized on CPU)."""
        if self.weight_type == "float":
            return KERNEL_FP8
        return KERNEL_INT4 if self.bits == 4 else KERNEL_INT8

    @property
    def scheme(self) -> str:
        """vLLM's name for it: W4A16, W8A16, W8A8, FP8."""
        if self.weight_type == "float":
            return "FP8"
        return f"W{self.bits}A{self.activation_bits or 16}"

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per channel"
        sym = "symmetric" if self.symmetric else "asymmetric"
        order = ", act order" if self.act_order else ""
        return f"{self.quant_method} {self.scheme} ({self.storage}, {group}, {sym}{order})"

    @property
    def bytes_per_weight(self) -> float:
        """Checkpoint bytes a quantized weight, scales and zero points included (16-bit
        scales; one per group, or per channel counted as free)."""
        per_group = 2.0 + (self.bits / 8 if not self.symmetric else 0.0)
        return self.bits / 8 + (per_group / self.group_size if self.group_size else 0.0)

    def is_quantized(self, module: str) -> bool:
        """Whether the Linear `module` (a Hugging Face name: model.layers.0.mlp.up_proj) is
        stored quantized."""
        if any(_matches(module, pattern) for pattern in self.ignore):
            return False
        return any(_matches(module, pattern) for pattern in self.targets)


    def quantizes_every_decoder_linear(self, num_layers: int) -> bool:
        """Whether every projection of every decoder layer is stored quantized (the fused
        decode step runs one weight form for all of them)."""
        return all(self.is_quantized(f"model.layers.{i}.{name}")
                   for i in range(num_layers) for name in DECODER_LINEARS)


def _matches(module: str, pattern: str) -> bool:
    """compressed-tensors' target grammar: "re:<regex>" on the module name, a class name
    ("Linear": every Linear, which are all we ask about), or a name or its last parts."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if pattern == "Linear":
        return True
    return module == pattern or module.endswith("." + pattern)


def parse_quantization_config(config: dict[str, Any], source: str = "config.json",
                              ) -> CheckpointQuantization | None:
    """`config["quantization_config"]` read, or None for an unquantized checkpoint; a
    ValueError naming the file and the scheme for one we cannot run."""
    raw = config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: quantization_config must be an object")
    method = raw.get("quant_method")
    try:
        if method == COMPRESSED_TENSORS:
            return _compressed_tensors(raw)
        if method in ("gptq", "awq"):
            return _legacy(raw, str(method))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source}: quantization_config is malformed ({exc!r})") from exc
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc
    raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not supported; "
                     f"supported: {COMPRESSED_TENSORS}, gptq, awq")


def _compressed_tensors(raw: dict[str, Any]) -> CheckpointQuantization:
    groups = raw.get("config_groups") or {}
    if raw.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not "
                         "supported")
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config_groups is not supported "
                         "(one scheme for every quantized Linear)")
    group = next(iter(groups.values()))
    weights = group.get("weights")
    if not weights:
        raise ValueError("compressed-tensors scheme without weight quantization is not "
                         "supported")
    storage = str(group.get("format") or raw.get("format") or "")
    weight_type, bits = str(weights["type"]), int(weights["num_bits"])
    strategy = str(weights.get("strategy"))
    symmetric = bool(weights.get("symmetric", True))
    group_size = weights.get("group_size") if strategy == "group" else None
    name = f"compressed-tensors {weight_type}{bits} {strategy} ({storage or 'no format'})"
    if weights.get("actorder") == "group":
        raise ValueError(f"{name} with actorder 'group' (g_idx) is not supported")
    if weights.get("dynamic"):
        raise ValueError(f"{name} with dynamic weight scales is not supported")
    activation_bits = _activations(group.get("input_activations"), weight_type, name)
    if weight_type == "int":
        if storage not in _INT_FORMATS:
            raise ValueError(f"{name}: format {storage!r} is not supported "
                             f"(supported: {', '.join(_INT_FORMATS)})")
        if bits == 4 and storage == "pack-quantized":
            _check_int4_groups(strategy, group_size, name)
        elif bits == 8 and storage in ("int-quantized", "naive-quantized"):
            if strategy not in ("channel", "tensor") or not symmetric:
                raise ValueError(f"{name}: int8 runs symmetric with one scale per channel "
                                 f"or tensor, got {strategy}, "
                                 f"{'symmetric' if symmetric else 'asymmetric'}")
        else:
            raise ValueError(f"{name}: {bits}-bit integer weights in {storage!r} are not "
                             "supported (int4 pack-quantized, int8 int-quantized)")
        if activation_bits is not None and bits != 8:
            raise ValueError(f"{name}: activation quantization with {bits}-bit weights "
                             "is not supported (W4A16, W8A16, W8A8)")
    elif weight_type == "float":
        if bits != 8 or storage not in _FLOAT_FORMATS or strategy not in ("channel", "tensor"):
            raise ValueError(f"{name}: only FP8 (e4m3) float-quantized weights with one scale "
                             "per channel or tensor are supported")
    else:
        raise ValueError(f"{name}: weight type {weight_type!r} is not supported")
    return CheckpointQuantization(
        quant_method=COMPRESSED_TENSORS, weight_type=weight_type, bits=bits,
        group_size=int(group_size) if group_size else None, symmetric=symmetric,
        storage=storage, activation_bits=activation_bits,
        targets=tuple(str(t) for t in group.get("targets") or ("Linear",)),
        ignore=tuple(str(i) for i in raw.get("ignore") or ()))


def _activations(args: dict[str, Any] | None, weight_type: str, name: str) -> int | None:
    if not args:
        return None
    if not args.get("dynamic") or args.get("strategy") not in ("token", "tensor"):
        raise ValueError(f"{name}: static or {args.get('strategy')} activation quantization is "
                         "not supported (dynamic per token only)")
    if args.get("type") != weight_type or int(args.get("num_bits", 0)) != 8:
        raise ValueError(f"{name}: activations {args.get('type')}{args.get('num_bits')} are "
                         "not supported (int8 with int8 weights, FP8 with FP8 weights)")
    return 8


def _check_int4_groups(strategy: str, group_size: Any, name: str) -> None:
    """Our int4 tile has groups of 32: a checkpoint group of 32k weights repeats its scale
    over k tiles' groups exactly; a smaller or odd group cannot be represented."""
    if strategy == "channel":
        return
    if strategy != "group" or not isinstance(group_size, int) or group_size % 32:
        raise ValueError(f"{name}: int4 needs groups of a multiple of 32 weights or one scale "
                         f"per channel, got strategy {strategy} group_size {group_size}")


def _legacy(raw: dict[str, Any], method: str) -> CheckpointQuantization:
    """AutoGPTQ (`quant_method: gptq`) and AutoAWQ (`awq`, GEMM version) layouts: qweight,
    qzeros, scales (and GPTQ's g_idx)."""
    bits = int(raw.get("bits", raw.get("w_bit", 0)))
    group_size = int(raw.get("group_size", raw.get("q_group_size", -1)))
    name = f"{method} {bits}-bit group {group_size}"
    if bits != 4:
        raise ValueError(f"{name}: only 4-bit {method} checkpoints are supported")
    if method == "awq" and str(raw.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{name}: AWQ version {raw.get('version')!r} is not supported (gemm)")
    if method == "gptq" and raw.get("checkpoint_format", "gptq") != "gptq":
        raise ValueError(f"{name}: checkpoint_format {raw.get('checkpoint_format')!r} is not "
                         "supported (gptq)")
    if raw.get("desc_act") and not raw.get("static_groups"):
        # Act order assigns input columns to groups out of order (g_idx); our int4 tile's
        # groups are 32 consecutive inputs, so it would need the activations permuted too.
        raise ValueError(f"{name} with desc_act (act order, a permuting g_idx) is not supported")
    _check_int4_groups("channel" if group_size == -1 else "group",
                       None if group_size == -1 else group_size, name)
    return CheckpointQuantization(
        quant_method=method, weight_type="int", bits=4,
        group_size=None if group_size == -1 else group_size,
        # GPTQ stores zero points even for sym=True checkpoints (all 8): read them all the same.
        symmetric=bool(raw.get("sym", False)) if method == "gptq" else not raw.get("zero_point", True),
        storage=method, act_order=bool(raw.get("desc_act", False)),
        ignore=tuple(str(m) for m in raw.get("modules_to_not_convert") or ("lm_head",)))
