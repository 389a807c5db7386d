"""`ServerConfig`: the HTTP side of `kvasir-engine serve`, frozen and validated once.

The engine flags (model, cache, scheduler) live in `args.py`; this module adds the flags only the
server needs. Each gets its `KVASIR_*` environment fallback from `args.apply_env_defaults`, so a
container can be configured without a command line and a bad value fails, naming the flag, before
the port opens.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ServerConfig:
    # vLLM's default, so a pod is reachable without flags; `make serve` passes 127.0.0.1.
    host: str = "0.0.0.0"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    # Largest accepted request body; 8 MiB holds a 128k-token prompt as token ids.
    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    # Prompts and completions are logged only when asked (they may hold personal data).
    log_requests: bool = False
    shutdown_grace_seconds: float = 30.0
    # A /ready probe waits at most this long for a token-producing step. Keep it below the
    # kubelet probe's timeoutSeconds, so the engine answers 503 with a reason before kubelet gives up.
    ready_timeout_seconds: float = 10.0
    # /ready answers at once (no step awaited) when a step produced tokens this recently; a
    # busy engine then answers in milliseconds, and a frozen one fails after this long.
    ready_recent_seconds: float = 5.0
    # /health fails when work is queued and no step finished for this long.
    health_stall_seconds: float = 30.0
    # Told to a client refused with 429 (queue full).
    retry_after_seconds: int = 1
    # Run a short generation before the first 200 from /ready (compiles, allocates, warms caches).
    warmup: bool = True

    def __post_init__(self) -> None:
        _require(bool(self.host), "--host must not be empty")
        _require(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        _require(all(k and k == k.strip() for k in self.api_keys),
                 "--api-key: keys must be non-empty and carry no surrounding whitespace")
        _require(self.max_body_bytes >= 1024,
                 f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        _require(self.max_n >= 1, f"--max-n must be >= 1, got {self.max_n}")
        for name, value in (("--shutdown-grace-seconds", self.shutdown_grace_seconds),
                            ("--ready-timeout-seconds", self.ready_timeout_seconds),
                            ("--ready-recent-seconds", self.ready_recent_seconds),
                            ("--health-stall-seconds", self.health_stall_seconds)):
            _require(math.isfinite(value) and value > 0, f"{name} must be > 0, got {value}")
        _require(self.retry_after_seconds >= 1,
                 f"--retry-after-seconds must be >= 1, got {self.retry_after_seconds}")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Adds the server flags to `serve`'s parser.

    `args.apply_env_defaults` then gives each one its `KVASIR_<FLAG>` fallback; keys also come
    from `KVASIR_API_KEYS` (comma-separated), read in `server_config_from_args`.
    """
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to bind (KVASIR_HOST)")
    g.add_argument("--port", type=int, default=d.port, help="(KVASIR_PORT)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="accepted bearer key; repeatable (KVASIR_API_KEYS: comma-separated)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file with one accepted key per line (KVASIR_API_KEY_FILE)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="larger request bodies get 413 (KVASIR_MAX_BODY_BYTES)")
    g.add_argument("--max-n", type=int, default=d.max_n,
                   help="largest accepted `n` (KVASIR_MAX_N)")
    g.add_argument("--log-requests", action="store_true", default=False,
                   help="log prompts and completions (KVASIR_LOG_REQUESTS)")
    g.add_argument("--shutdown-grace-seconds", type=float,
                   default=d.shutdown_grace_seconds,
                   help="on SIGTERM, in-flight requests get this long (KVASIR_SHUTDOWN_GRACE_SECONDS)")
    g.add_argument("--ready-timeout-seconds", type=float,
                   default=d.ready_timeout_seconds,
                   help="bound of one /ready probe (KVASIR_READY_TIMEOUT_SECONDS)")
    g.add_argument("--ready-recent-seconds", type=float,
                   default=d.ready_recent_seconds,
                   help="/ready answers at once when a step produced tokens this recently "
                        "(KVASIR_READY_RECENT_SECONDS)")
    g.add_argument("--health-stall-seconds", type=float,
                   default=d.health_stall_seconds,
                   help="/health fails when queued work saw no step for this long "
                        "(KVASIR_HEALTH_STALL_SECONDS)")
    g.add_argument("--no-warmup", action="store_true", default=False,
                   help="skip the warm-up generation (KVASIR_NO_WARMUP)")


def _read_key_file(path: str) -> list[str]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--api-key-file: cannot read {path}: {e.strerror}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def server_config_from_args(ns: argparse.Namespace) -> ServerConfig:
    """Builds the frozen config; raises ValueError with the flag's name on a bad value."""
    # KVASIR_API_KEY reaches us as one string (an env default), --api-key as a list.
    given = ns.api_key or []
    keys: list[str] = given.split(",") if isinstance(given, str) else list(given)
    env_keys = os.environ.get("KVASIR_API_KEYS", "")
    keys += env_keys.split(",")
    if ns.api_key_file:
        keys += _read_key_file(ns.api_key_file)
    return ServerConfig(
        host=ns.host,
        port=ns.port,
        api_keys=tuple(dict.fromkeys(k.strip() for k in keys if k.strip())),
        max_body_bytes=ns.max_body_bytes,
        max_n=ns.max_n,
        log_requests=ns.log_requests,
        shutdown_grace_seconds=ns.shutdown_grace_seconds,
        ready_timeout_seconds=ns.ready_timeout_seconds,
        ready_recent_seconds=ns.ready_recent_seconds,
        health_stall_seconds=ns.health_stall_seconds,
        warmup=not ns.no_warmup,
    )
