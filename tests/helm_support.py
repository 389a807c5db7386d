"""`helm` for the tests of every tree: found on PATH or in .tools/bin, else installed there by
shared/tools/install-helm (beside the checkout, for sessions and CI alike); `template` renders
the chart and parses it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvasir"
TOOLS = ROOT / ".tools" / "bin"
# shared/ lies beside the repository checkout (for sessions and for CI alike).
INSTALL_HELM = ROOT.parent / "shared" / "tools" / "install-helm"


@pytest.fixture(scope="module")
def helm() -> str:
    found = shutil.which("helm") or (str(TOOLS / "helm") if (TOOLS / "helm").exists() else None)
    if found is None and INSTALL_HELM.exists():
        subprocess.run([str(INSTALL_HELM), str(TOOLS)], check=False, capture_output=True,
                       timeout=300)
        found = str(TOOLS / "helm") if (TOOLS / "helm").exists() else None
    if found is None:
        pytest.skip(f"helm is not installed and {INSTALL_HELM} could not install it")
    return found


def template(helm: str, *sets: str, kube_version: str | None = None) -> list[dict[str, Any]]:
    """`helm template` of the chart (release kv in namespace kvasir), parsed; `kube_version`
    sets Capabilities.KubeVersion (checked against Chart.yaml's kubeVersion)."""
    args = [helm, "template", "kv", str(CHART), "--namespace", "kvasir", "--include-crds"]
    if kube_version is not None:
        args += ["--kube-version", kube_version]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache"})
    return [d for d in yaml.safe_load_all(out.stdout) if d]
