"""Pick the attention backend: "torch" on CPU, "triton" on CUDA, or what --attention-backend says.

The Triton backend is imported lazily: it needs triton and a GPU, neither present on CPU hosts.
"""

from __future__ import annotations

from kvasir_engine.attention.backend import AttentionBackend
from kvasir_engine.config import DeviceConfig


def select_backend(device_config: DeviceConfig, device: str) -> AttentionBackend:
    name = device_config.attention_backend
    if name == "auto":
        name = "triton" if device == "cuda" else "torch"
    if name == "triton":
        if device != "cuda":
            raise ValueError("--attention-backend triton needs a CUDA device")
        from kvasir_engine.attention.triton_backend import TritonAttentionBackend

        backend: AttentionBackend = TritonAttentionBackend()
        return backend
    from kvasir_engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
