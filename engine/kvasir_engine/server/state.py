"""`ServerState`: what every route needs, built once by `create_app` and kept on `app.state`.

Only `is_warm` and `is_draining` change after start-up (warm-up done; SIGTERM received).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvasir_engine.config import EngineConfig
from kvasir_engine.core.limits import FitError
from kvasir_engine.frontend.metrics import EngineMetrics
from kvasir_engine.frontend.prefix_cache_view import PrefixCacheView
from kvasir_engine.kv_transfer.connector import KVConnector
from kvasir_engine.server.admission import AdmissionLimits
from kvasir_engine.server.async_engine import AsyncEngine
from kvasir_engine.server.config import ServerConfig
from kvasir_engine.server.text_work import TextWork
from kvasir_engine.server.tracing import RequestTracer


@dataclass
class ServerState:
    engine_config: EngineConfig
    server_config: ServerConfig
    async_engine: AsyncEngine
    # kvasir_engine.tokenizer.Tokenizer: encode, decode, apply_chat_template.
    tokenizer: Any
    metrics: EngineMetrics
    system_fingerprint: str
    # The core's one "could this ever be scheduled" check (`Scheduler.fit_error`): (prompt
    # tokens, max_tokens) -> why not, or None.
    fit_error: Callable[[int, int], FitError | None]
    # The queue bounds, resolved from both configs (admission.py).
    admission_limits: AdmissionLimits
    # Tokenisation and detokenisation off the event loop, long texts refused by length.
    text_work: TextWork
    # The model runner's kernel choice as RuntimeInfo reported it (op -> kernel), for /version.
    kernels: dict[str, str | bool] = field(default_factory=dict)
    # What the prefix cache holds, for the gateway (server/prefix_cache.py); None: caching off.
    prefix_cache_view: PrefixCacheView | None = None
    # Disaggregated prefill's end of this engine (server/disagg.py); None: not configured.
    kv_connector: KVConnector | None = None
    # OpenTelemetry spans of generation requests (tracing.py); None: tracing off.
    tracer: RequestTracer | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    is_warm: bool = False
    is_draining: bool = False

    @property
    def model_name(self) -> str:
        return self.engine_config.model.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.engine_config.model.max_model_len
