"""`/version` reports the model runner's kernel choice and compute team (as RuntimeInfo carried
them to the server) next to the version, and its KV-transfer role (None here), for a live server on the tiny float32 model."""

from __future__ import annotations

from harness import LiveServer
from kvasir_engine.kernels.choice import KernelChoice, build_kernel_choice


def test_version_shows_the_kernel_choice(server: LiveServer) -> None:
    body = server.get("/version", headers={"Authorization": "Bearer test-key-1"}).json()
    assert body["version"]
    assert body["kv_role"] is None  # no --kv-transfer-config (the gateway routes by it)
    kernels = body["kernels"]
    # The compute team on a CPU engine: its size at start, why, and whether it adapts.
    team = kernels.pop("cpu_threads")
    assert team.split(" ", 1)[0].isdigit() and "(" in team, team
    assert set(kernels) == set(KernelChoice().as_dict())
    expected = build_kernel_choice(server.state.engine_config, "cpu")
    assert kernels == expected.as_dict()
    native = "native" if expected.native_cpu_kernels else "torch"
    assert kernels["attention_backend"] == "torch" and kernels["norm"] == native
    assert kernels["matmul"] == "torch" and kernels["fused_decode"] is False  # unquantized
