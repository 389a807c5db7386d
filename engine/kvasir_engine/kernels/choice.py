"""Which kernel runs each op, decided once per process: `KernelChoice` and its one builder.

The model runner builds the choice at start-up from the `EngineConfig` and the host (the
device, whether the native CPU kernels of csrc/ built, the compute and KV dtypes, the
quantization) and hands it down to the model, which gives each layer its part at
construction; no layer looks at the host or the environment while it runs. The choice is
logged once and reported through `RuntimeInfo` (the server's `/version` shows it).

This module is also the only reader of the environment switches that pick kernels:
KVASIR_NATIVE_CPU_KERNELS=0 keeps the torch ops on CPU (the extension is then never built),
and TRITON_INTERPRET=1 runs the Triton kernels under Triton's interpreter (set by default
where there is no GPU, see `kernels/__init__.py`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from kvasir_engine.checkpoint.quant_config import KERNEL_FP8
from kvasir_engine.config import EngineConfig
from kvasir_engine.kernels.host import cpu_has, onednn_available

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("torch", "triton")
# Per-op implementations: "torch" is the reference everywhere; "native" the C++ kernels of
# kernels/cpu.py (x86 CPUs); "triton" the fused kernels of kernels/*.py (the Triton backend).
LAYER_IMPLS = ("torch", "native", "triton")
DENSE_MATMULS = ("torch", "onednn", "native")
PREFILL_ATTENTIONS = ("matmul", "sdpa", "native")
FP8_MATMULS = ("dequantized", "scaled_mm")
INT4_PREFILLS = ("tile", "weight_only")
# Activations and caches the native kernels take (kernels/cpu.py:NATIVE_DTYPES, by name).
NATIVE_DTYPE_NAMES = ("float32", "bfloat16")


@dataclass(frozen=True)
class KernelChoice:
    """The kernels of one process. The defaults are the pure-torch reference path."""

    attention_backend: str = "torch"  # attention/selector.py builds it: "torch" | "triton"
    # Decode rows of the torch backend: "native" (one C++ call a layer) or "torch";
    # "triton" with the Triton backend, whose kernels do decode too.
    decode_attention: str = "torch"
    # bfloat16/float16 prefill rows of the torch backend: "sdpa" (CPUs with AMX, where it is
    # ~3x faster), "native" (bfloat16 queries and caches on AVX512-BF16 CPUs without AMX: the
    # C++ flash kernel of kernels/csrc/cpu_prefill.cpp) or "matmul" (chunks of queries,
    # faster than SDPA elsewhere); float32 is always SDPA.
    prefill_attention: str = "matmul"
    norm: str = "torch"  # RMSNorm (+ residual add): torch | native | triton
    rotary: str = "torch"  # RoPE of query and key: torch | native | triton
    activation: str = "torch"  # SwiGLU gate: torch | native
    # Quantized products (--quantization): "native" (C++ int8/int4 kernels, padded layouts)
    # or "torch" (the fallback layouts).
    matmul: str = "torch"
    # The quantized products multiply the activations as they are, in the compute dtype (a
    # weight-only checkpoint: W4A16, W8A16, GPTQ, AWQ); False: int8 activations (the int8 /
    # int4 tiles of --quantization and W8A8 checkpoints), or nothing quantized.
    weight_only: bool = False
    # --quantization int4's prompt rows in bfloat16 (more than a decode's 16 rows): "tile"
    # (int8 activations, as its decode rows) or "weight_only" (the same codes dequantized in
    # chunks times the activations as they are, through oneDNN: cpu_quant_wo.cpp; 0.24-0.76x
    # the tile's time from 24 rows on AVX512-BF16 / AMX CPUs, chosen there but under
    # --batch-invariant).
    int4_prefill: str = "tile"
    # Unquantized products: "torch" (F.linear), or bfloat16 on CPU with weights packed once
    # (layers/dense.py): "onednn", or "native" (AVX512-BF16 dot products, hosts without AMX).
    dense_matmul: str = "torch"
    # A pre-quantized FP8 checkpoint's products: "scaled_mm" (FP8 on a GPU of compute
    # capability >= 8.9, kernels/fp8.py) or "dequantized" (its weights in the compute dtype).
    fp8_matmul: str = "dequantized"
    fused_decode: bool = False  # decode-only steps through models/fused_decode.py
    # --batch-invariant: every attention row through one algorithm (attention/invariant.py:
    # the native decode kernel where decode_attention is "native", else its torch twin), and
    # the "onednn" / "torch" products in fixed tiles of rows (layers/dense.py).
    batch_invariant: bool = False
    native_cpu_kernels: bool = False  # the extension is enabled and built on this host
    triton_interpret: bool = False  # Triton kernels run under the interpreter

    def __post_init__(self) -> None:
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        for name in ("decode_attention", "norm", "rotary", "activation", "matmul"):
            _one_of(name, getattr(self, name), LAYER_IMPLS)
        native = [n for n in ("decode_attention", "norm", "rotary", "activation", "matmul")
                  if getattr(self, n) == "native"]
        if (native or self.fused_decode) and not self.native_cpu_kernels:
            raise ValueError(f"kernel choice: {native or ['fused_decode']} native without "
                             "the native CPU kernels")
        if self.prefill_attention not in PREFILL_ATTENTIONS:
            raise ValueError(f"kernel choice: prefill_attention must be one of "
                             f"{PREFILL_ATTENTIONS}, got {self.prefill_attention!r}")
        _one_of("fp8_matmul", self.fp8_matmul, FP8_MATMULS)
        _one_of("int4_prefill", self.int4_prefill, INT4_PREFILLS)
        if self.dense_matmul not in DENSE_MATMULS:
            raise ValueError(f"kernel choice: dense_matmul must be one of {DENSE_MATMULS}, "
                             f"got {self.dense_matmul!r}")
        if self.fused_decode and self.matmul != "native" and self.dense_matmul == "torch":
            raise ValueError("kernel choice: fused decode needs the native quantized matmuls "
                             "or packed bfloat16 ones")
        if self.prefill_attention == "native" and not self.native_cpu_kernels:
            raise ValueError("kernel choice: prefill_attention native without the native CPU "
                             "kernels")
        if self.dense_matmul == "native" and not self.native_cpu_kernels:
            raise ValueError("kernel choice: dense_matmul native without the native CPU kernels")
        triton = [n for n in ("decode_attention", "norm", "rotary")
                  if getattr(self, n) == "triton"]
        if triton and self.attention_backend != "triton":
            raise ValueError(f"kernel choice: {triton} triton without the triton backend")

    @property
    def dense_packing(self) -> str | None:
        """How `pack_model` lays out the unquantized weights (layers/dense.py:pack_dense);
        None: left as they are."""
        if self.batch_invariant and self.dense_matmul != "native":
            return f"{self.dense_matmul}_rows"
        return None if self.dense_matmul == "torch" else self.dense_matmul

    def as_dict(self) -> dict[str, str | bool]:
        """Plain data for `RuntimeInfo` and the server's /version."""
        return asdict(self)

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.as_dict().items())


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"kernel choice: {name} must be one of {allowed}, got {value!r}")


def native_cpu_kernels_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False under KVASIR_NATIVE_CPU_KERNELS=0."""
    environ = os.environ if environ is None else environ
    return environ.get("KVASIR_NATIVE_CPU_KERNELS", "1") != "0"


def triton_interpreted(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("TRITON_INTERPRET") == "1"


def default_to_triton_interpreter(has_cuda: bool) -> None:
    """Without CUDA, Triton kernels can only run under the interpreter, which `@triton.jit`
    picks when TRITON_INTERPRET=1 is set at decoration time; an explicit value is left alone."""
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _cuda_fp8() -> bool:
    import torch

    from kvasir_engine.kernels.fp8 import fp8_supported

    return fp8_supported(torch.device("cuda", torch.cuda.current_device()))


def _one_weight_form(config: EngineConfig) -> bool:
    """False for a pre-quantized checkpoint that leaves some decoder projection unquantized:
    the fused decode step takes one weight form for every layer."""
    quant = config.model.checkpoint_quantization
    return (quant is None or config.model.quantization is None
            or quant.quantizes_every_decoder_linear(config.model.arch.num_hidden_layers))


def build_kernel_choice(config: EngineConfig, device: str,
                        native_cpu_built: Callable[[], bool] | None = None,
                        environ: Mapping[str, str] | None = None,
                        cuda_fp8: Callable[[], bool] = _cuda_fp8) -> KernelChoice:
    """The choice for `config` on this host; `device` is the resolved one ("cpu" | "cuda").

    `native_cpu_built` answers whether the native CPU kernels build and load here (default
    `kernels.cpu.available`, which builds them on first use); it is asked only on CPU and
    only when KVASIR_NATIVE_CPU_KERNELS is not 0. `cuda_fp8` answers whether the CUDA device
    multiplies FP8 (asked only for an FP8 checkpoint on CUDA).
    """
    backend = config.device.attention_backend
    if backend == "auto":
        backend = "triton" if device == "cuda" else "torch"
    if backend == "triton" and device != "cuda":
        raise ValueError("--attention-backend triton needs a CUDA device")
    native = False
    if device == "cpu":
        if not native_cpu_kernels_enabled(environ):
            logger.info("native CPU kernels disabled by KVASIR_NATIVE_CPU_KERNELS=0")
        else:
            if native_cpu_built is None:
                from kvasir_engine.kernels import cpu

                native_cpu_built = cpu.available
            native = native_cpu_built()
    dtype = config.model.dtype
    kv_dtype = config.cache.resolved_kv_cache_dtype(dtype)
    quantized = config.model.quantization is not None
    packed = device == "cpu" and dtype == "bfloat16" and not quantized and onednn_available()
    # The AVX512-BF16 products (layers/dense.py) where oneDNN has no AMX to use, for models
    # whose layer widths all fit their layout (one form for every layer of the fused decode).
    arch = config.model.arch
    widths = (arch.hidden_size, arch.intermediate_size, arch.num_attention_heads * arch.head_dim,
              arch.num_key_value_heads * arch.head_dim)
    pairs = (packed and native and cpu_has("avx512_bf16") and not cpu_has("amx_bf16")
             and all(w % 16 == 0 for w in widths))
    rows = native and dtype in NATIVE_DTYPE_NAMES  # the row-wise layers' dtypes
    # The C++ decode attention reads heads in vectors of 8.
    native_attention = (rows and kv_dtype in NATIVE_DTYPE_NAMES
                        and config.model.arch.head_dim % 8 == 0)
    is_triton = backend == "triton"
    prefill = "matmul"
    if device == "cpu" and cpu_has("amx_bf16"):
        prefill = "sdpa"
    elif (native and cpu_has("avx512_bf16") and dtype == kv_dtype == "bfloat16"
          and arch.head_dim in (32, 64, 128)):
        prefill = "native"
    quant = config.model.checkpoint_quantization
    is_fp8 = quant is not None and quant.kernel == KERNEL_FP8
    weight_only = quantized and quant is not None and quant.activation_bits is None
    invariant = config.device.batch_invariant
    dense = "native" if pairs else "onednn" if packed else "torch"
    # Its chunks' sums follow the row count, hence not under --batch-invariant.
    int4_prefill = ("weight_only" if config.model.quantization == "int4" and quant is None
                    and native and dtype == "bfloat16" and not invariant
                    and (cpu_has("avx512_bf16") or cpu_has("amx_bf16")) else "tile")
    if invariant and quantized and not native:
        raise ValueError(f"--batch-invariant with --quantization {config.model.quantization} "
                         "needs the native CPU kernels (x86-64 with AVX2, "
                         "KVASIR_NATIVE_CPU_KERNELS not 0): the torch int8/int4 products' "
                         "sums follow the row count")
    return KernelChoice(
        attention_backend=backend,
        decode_attention="triton" if is_triton else "native" if native_attention else "torch",
        prefill_attention=prefill,
        norm="triton" if is_triton else "native" if rows else "torch",
        rotary="triton" if is_triton else "native" if rows else "torch",
        activation="native" if rows else "torch",
        matmul="native" if native and quantized else "torch",
        weight_only=weight_only,
        int4_prefill=int4_prefill,
        dense_matmul=dense,
        # cuBLASLt's row-wise scaled FP8 products write bfloat16 only.
        fp8_matmul=("scaled_mm" if is_fp8 and device == "cuda" and dtype == "bfloat16"
                    and cuda_fp8() else "dequantized"),
        # Under --batch-invariant only with the products whose sums are a row's own (the
        # native int8/int4 and AVX512-BF16 ones): the fused step multiplies a decode batch whole.
        fused_decode=(native_attention and (quantized or packed) and _one_weight_form(config)
                      and config.parallel.tensor_parallel_size == 1
                      and (not invariant or quantized or dense == "native")),
        native_cpu_kernels=native,
        triton_interpret=triton_interpreted(environ),
        batch_invariant=invariant,
    )
