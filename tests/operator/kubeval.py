"""kubernetes-validate, strict, over the Kubernetes versions the chart declares.

The versions come from the installed package (its newest is the newest it ships, so upgrading
the package widens the check) and from Chart.yaml's `kubeVersion` floor: every object is valid
on every minor version from the floor to the newest, which is what "supported" promises.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import kubernetes_validate
import yaml
from crd_schema import ROOT
from kubernetes_validate import utils
from packaging.version import Version

CHART_YAML = ROOT / "charts" / "kvasir" / "Chart.yaml"
# Kinds from CRDs that kubernetes-validate cannot know (Prometheus Operator); each is named here
# so that any other unknown kind fails instead of passing unchecked.
FOREIGN_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"),
                 ("monitoring.coreos.com/v1", "PrometheusRule"),
                 ("monitoring.coreos.com/v1", "PodMonitor"),
                 ("keda.sh/v1alpha1", "ScaledObject")}


def chart_floor() -> Version:
    declared = yaml.safe_load(CHART_YAML.read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*v?(\d+)\.(\d+)\.(\d+)(-0)?", declared.strip())
    if match is None:
        raise ValueError(f"Chart.yaml kubeVersion {declared!r}: expected '>=X.Y.Z-0'")
    return Version(".".join(match.groups()[:3]))


@cache
def latest() -> str:
    return str(utils.latest_version())


def supported_versions() -> list[str]:
    """Every minor version kubernetes-validate ships from the chart's floor up, newest last."""
    shipped = sorted({Version(v) for v in utils.all_versions()})
    return [str(v) for v in shipped if v >= chart_floor()]


def errors(obj: dict[str, Any], version: str | None = None) -> list[str]:
    """[] when the object is valid (strict: no unknown fields) on that version, else why."""
    version = version or latest()
    if (obj.get("apiVersion"), obj.get("kind")) in FOREIGN_KINDS:
        return []
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(map(str, exc.path))
        return [f"{obj['kind']}/{obj['metadata'].get('name')} on {version}: {where}: "
                f"{exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{obj['kind']} on {version}: {exc.message}"]
    return []
