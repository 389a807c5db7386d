"""`GatewayContext`: what the request path shares, built once by app.py and handed down.

The proxy, the shadows and the upstream exchange read the gateway's state through this one
frozen object, never through app.py: app.py builds it (with the routes, and the background tasks
that keep its parts fresh) and no module below imports app.py (`.importlinter`,
"gateway-layers"). Its fields never change after start; the objects they hold change inside: the
replicas' state (the probes), the router's prefix indexes, the open leases, the routing file's
table in force.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from kvasir_gateway.aliases import RoutingTable
from kvasir_gateway.client import UpstreamClient
from kvasir_gateway.config import GatewayConfig
from kvasir_gateway.cost import CostModel
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.placement import Router
from kvasir_gateway.quota import OpenLeases, QuotaStore
from kvasir_gateway.replicas import ReplicaSet
from kvasir_gateway.routing_file import RoutingFile
from kvasir_gateway.tenants import KeyFile


@dataclass(frozen=True)
class GatewayContext:
    config: GatewayConfig
    metrics: GatewayMetrics
    keys: KeyFile | None  # None: no --api-key-file, every request is the anonymous tenant
    store: QuotaStore  # in this process, or in Redis, shared by every gateway replica
    leases: OpenLeases  # of the requests running now, renewed by app.py
    replicas: ReplicaSet
    router: Router  # the routing policy, chosen once; it holds the prefix indexes
    # a disaggregated request's decode stage: the least loaded consumer (upstream.py)
    decode_router: Router
    routing_file: RoutingFile | None  # None: the config's routing table, for good
    costs: CostModel  # each priced pool's cost per token, now
    client: UpstreamClient  # open while the app runs
    # OpenTelemetry (tracing.py); None: tracing off, the request path checks only this.
    tracer: Tracer | None = None
    tracer_provider: TracerProvider | None = None

    @property
    def routing_table(self) -> RoutingTable:
        """The aliases and pools in force now (routing_file.py reloads them)."""
        if self.routing_file is None:
            return self.config.routing_table
        return self.routing_file.table
