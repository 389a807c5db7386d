"""The attention backend of a `KernelChoice`: "torch" (CPU, or forced) or "triton" (CUDA).

Which one is decided once, in kernels/choice.py (`--attention-backend`, the device). The
Triton backend is imported lazily: it needs triton and a GPU, neither present on CPU hosts.
"""

from __future__ import annotations

from kvasir_engine.attention.backend import AttentionBackend
from kvasir_engine.kernels.choice import KernelChoice


def make_backend(kernels: KernelChoice) -> AttentionBackend:
    if kernels.attention_backend == "triton":
        from kvasir_engine.attention.triton_backend import TritonAttentionBackend

        backend: AttentionBackend = TritonAttentionBackend()
        return backend
    from kvasir_engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(native_decode=kernels.decode_attention == "native",
                                 sdpa_prefill=kernels.prefill_attention == "sdpa",
                                 native_prefill=kernels.prefill_attention == "native",
                                 batch_invariant=kernels.batch_invariant)
