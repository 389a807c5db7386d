"""The routing policy is a type decided once: the config holds a `RoutingPolicy`, app.py builds
its router, and each router places a request the way its policy says (pure, no server)."""

from __future__ import annotations

import asyncio

import pytest
from kvasir_gateway.app import build_router
from kvasir_gateway.client import UpstreamClient
from kvasir_gateway.config import GatewayConfig
from kvasir_gateway.metrics import GatewayMetrics
from kvasir_gateway.placement import LeastLoadRouter, PrefixRouter, RoundRobinRouter
from kvasir_gateway.precise import PreciseRouter
from kvasir_gateway.replicas import Replica, ReplicaSet
from kvasir_gateway.router import RoutingPolicy

BODY = {"model": "m", "prompt": "Policy text. " * 200}


def _router(policy: str) -> object:
    config = GatewayConfig(routing=policy)  # type: ignore[arg-type]  # a name, as tests pass it
    metrics = GatewayMetrics()
    replicas = ReplicaSet(metrics, headers={}, probe_interval=1.0, probe_timeout=1.0,
                          eject_seconds=1.0)
    return build_router(config, UpstreamClient(None, 1.0), metrics, replicas)


@pytest.mark.parametrize(("name", "router_type"), [
    ("prefix", PrefixRouter), ("precise", PreciseRouter), ("round_robin", RoundRobinRouter),
    ("least_load", LeastLoadRouter)])
def test_a_policy_name_becomes_its_type_and_its_router(name: str, router_type: type) -> None:
    config = GatewayConfig(routing=name)  # type: ignore[arg-type]
    assert config.routing is RoutingPolicy(name)
    assert type(_router(name)) is router_type


def test_an_unknown_policy_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--routing must be one of prefix, precise, "
                                         "least_load, round_robin, got 'random'"):
        GatewayConfig(routing="random")  # type: ignore[arg-type]


def test_prefix_placement_keeps_a_prefix_where_it_was_sent() -> None:
    router = _router("prefix")
    assert isinstance(router, PrefixRouter)
    replicas = [Replica(f"http://r{i}", is_ready=True) for i in range(3)]
    first = asyncio.run(router.place("/v1/completions", "t", BODY, 600))
    choice = first.pick(replicas)
    assert choice is not None and choice.reason == "new"
    first.record(choice.replica.url)
    again = asyncio.run(router.place("/v1/completions", "t", BODY, 600)).pick(replicas)
    assert again is not None and again.reason == "prefix"
    assert again.replica.url == choice.replica.url


def test_round_robin_takes_a_turn_per_attempt_across_requests() -> None:
    router = _router("round_robin")
    assert isinstance(router, RoundRobinRouter)
    replicas = [Replica(f"http://r{i}", is_ready=True) for i in range(3)]
    urls = []
    for _ in range(4):
        choice = asyncio.run(router.place("/v1/completions", "t", BODY, 600)).pick(replicas)
        assert choice is not None
        urls.append(choice.replica.url)
    assert urls == ["http://r0", "http://r1", "http://r2", "http://r0"]
