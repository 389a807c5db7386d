"""Runs e2e/scenario.sh against the current kube context; skipped when no cluster is reachable.

Run explicitly: `pytest e2e` (it is outside the default testpaths). Needs kubectl and helm on
PATH (or HELM=/path/to/helm) and the images loaded in the cluster (`make images`, `kind load`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from kvasir_operator import k8s
from kvasir_operator.settings import Settings

HERE = Path(__file__).resolve().parent


async def _version() -> str:
    async with k8s.K8sClient.from_settings(Settings.from_env(os.environ)) as client:
        text: str = await client._request("GET", "/version", raw=True)
        return text


def _cluster_reachable() -> str | None:
    try:
        asyncio.run(asyncio.wait_for(_version(), timeout=5))
    except Exception as e:  # any failure means: no cluster for this run
        return f"no Kubernetes cluster reachable ({type(e).__name__}: {e})"
    if shutil.which("kubectl") is None:
        return "kubectl is not on PATH"
    return None


@pytest.mark.slow
def test_scenario() -> None:
    reason = _cluster_reachable()
    if reason:
        pytest.skip(reason)
    subprocess.run([str(HERE / "scenario.sh")], check=True, timeout=3600)
