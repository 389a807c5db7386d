"""OpenAI's `system_fingerprint`: names what produced an answer, so it can be audited and replayed.

Derived from the model's digest, the compute dtype and quantization (and the KV cache's dtype
where it differs), the engine version and the device. The model digest hashes every file's
name and size plus its first and last MiB (hashing whole multi-GB weights would delay start-up
by minutes; the operator's fetcher verifies full SHA-256s against the manifest before the
engine starts).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvasir_engine import __version__
from kvasir_engine.config import EngineConfig

_SAMPLE_BYTES = 1 << 20


def _file_digest(path: Path, h: hashlib._Hash) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}:".encode())
    with path.open("rb") as f:
        h.update(f.read(_SAMPLE_BYTES))
        if size > 2 * _SAMPLE_BYTES:
            f.seek(size - _SAMPLE_BYTES)
            h.update(f.read(_SAMPLE_BYTES))


def model_digest(model: str) -> str:
    path = Path(model)
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        _file_digest(f, h)
    return h.hexdigest()


def system_fingerprint(config: EngineConfig, device: str) -> str:
    m = config.model
    parts = [model_digest(m.model), m.dtype, m.quantization or "none", __version__, device,
             f"tp{config.parallel.tensor_parallel_size}"]
    kv_dtype = config.cache.resolved_kv_cache_dtype(m.dtype)
    if kv_dtype != m.dtype:  # answers depend on the cache's rounding too
        parts.append(f"kv-{kv_dtype}")
    return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
