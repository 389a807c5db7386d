"""The shipped examples: the PrometheusRule passes promtool, the KEDA object targets the CRD."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvasir_operator import labels
from kvasir_operator.autoscale.signals import SIGNAL_TO_METRIC_NAMES

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
KNOWN_METRICS = {name for names in SIGNAL_TO_METRIC_NAMES.values() for name in names}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`)")

RULE_TEST = """\
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'vllm:num_requests_waiting{namespace="ns", model_name="m", pod="a"}'
        values: '0 3 3 3 3 3 3 3 3 3 3 3 3 3 3'
      - series: 'vllm:num_requests_waiting{namespace="ns", model_name="idle", pod="b"}'
        values: '0 0 0 0 0 0 0 0 0 0 0 0 0 0 0'
    alert_rule_test:
      - eval_time: 5m
        alertname: KvasirRequestsWaiting
        exp_alerts: []
      - eval_time: 12m
        alertname: KvasirRequestsWaiting
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ns, model_name: m}
            exp_annotations:
              summary: "m: requests have been waiting for 10 minutes"
              description: "3 requests are queued in ns/m. Check `kubectl describe kisvc` (status.autoscaling.reason, Events ScalingLimited)."
"""


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    return doc


@needs_promtool
def test_prometheus_rule_passes_promtool_and_fires_after_ten_minutes(tmp_path: Path) -> None:
    rule = load("prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    (tmp_path / "test.yaml").write_text(RULE_TEST)
    assert PROMTOOL is not None
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "test.yaml"]):
        done = subprocess.run([PROMTOOL, *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def test_keda_scaled_object_targets_the_scale_subresource_with_known_metrics() -> None:
    scaled = load("keda-scaledobject.yaml")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == (labels.API_VERSION, labels.KIND)
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert queries and all(any(m in q for m in KNOWN_METRICS) for q in queries)
    assert all(t["metricType"] == "AverageValue" for t in scaled["spec"]["triggers"])


def test_rule_metrics_are_ones_the_autoscaler_reads() -> None:
    rules = load("prometheusrule.yaml")["spec"]["groups"][0]["rules"]
    assert all(any(m in r["expr"] for m in KNOWN_METRICS) for r in rules)
