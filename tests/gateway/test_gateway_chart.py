"""The chart's gateway objects: off by default; when on, a Deployment whose flags the gateway's
own parser accepts (the routing file too), a Service, a ServiceAccount and, per fronted namespace, a Role that grants
get/list/watch on EndpointSlices and nothing more; every object valid (kubernetes-validate,
strict)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml
from helm_support import template
from kvasir_gateway.aliases import parse_routing
from kvasir_gateway.config import config_from_args


def gateway_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs
            if d["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "kvasir-gateway"]


def test_gateway_is_off_by_default(helm: str) -> None:
    assert gateway_objects(template(helm)) == []


def test_gateway_objects_least_privilege_and_valid(helm: str) -> None:
    docs = gateway_objects(template(
        helm, "gateway.enabled=true", "gateway.replicas=2", "gateway.services={llama,team/qwen:8000}",
        "gateway.apiKeySecret.name=tenant-keys", "gateway.upstreamKeySecret.name=gw-key",
        "gateway.redis.url=redis://redis:6379/0", "gateway.redis.failure=closed",
        "gateway.quota.tokensPerMinute=100000", r"gateway.quota.tenants.team-a=tpm:5000\,rpm:10"))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Role", "Role", "RoleBinding", "RoleBinding", "Service",
                     "ServiceAccount"]
    roles = {d["metadata"]["namespace"]: d["rules"] for d in docs if d["kind"] == "Role"}
    assert roles == {ns: [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                           "verbs": ["get", "list", "watch"]}] for ns in ("kvasir", "team")}
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kv-gateway",
                                        "namespace": "kvasir"}]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2
    container = dep["spec"]["template"]["spec"]["containers"][0]
    config = config_from_args(
        [a for a in container["args"] if not a.startswith("--upstream-key-file")])
    assert [(s.namespace, s.service, s.port) for s in config.endpoint_slices] == [
        ("kvasir", "llama", None), ("team", "qwen", 8000)]
    assert config.api_key_file == "/etc/kvasir-gateway/keys/keys"
    assert config.redis_url == "redis://redis:6379/0" and config.redis_fail_open is False
    assert config.default_limits.tokens_per_minute == 100000
    assert config.tenant_limits["team-a"].requests_per_minute == 10
    assert config.routing == "prefix"  # prefixRouting: approximate, the default
    assert (config.load_bound, config.prefix_miss_weight, config.load_tokens_per_request) == (
        0.6, 2.0, 16.0)  # the chart's defaults are the gateway's
    assert (config.disaggregation, config.disaggregation_min_prompt_tokens,
            config.disaggregation_prefill_timeout_seconds) == ("auto", 128, 30.0)  # the same
    assert "--upstream-key-file=/etc/kvasir-gateway/upstream/key" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = str(kubernetes_validate.utils.latest_version())
    for obj in docs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_gateway_routing_file_from_values(helm: str) -> None:
    docs = gateway_objects(template(
        helm, "gateway.enabled=true", "gateway.services={llama}",
        "gateway.routing.aliases.chat.cascade={small,large}",
        "gateway.routing.aliases.chat.checks.refusal_regex=Sorry",
        "gateway.routing.pools.small.cost_per_hour=2"))  # --set: ints only
    routing = next(d for d in docs if d["kind"] == "ConfigMap")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]
    assert "kvasir.dev/routing-checksum" not in (pod["metadata"].get("annotations") or {})
    args = pod["spec"]["containers"][0]["args"]
    path = next(a.split("=", 1)[1] for a in args if a.startswith("--routing-file="))
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"]
                 if m["name"] == "routing")
    assert path.startswith(mount["mountPath"] + "/")
    assert next(v for v in pod["spec"]["volumes"] if v["name"] == "routing")[
        "configMap"]["name"] == routing["metadata"]["name"]
    text = routing["data"][path.rsplit("/", 1)[1]]
    table = parse_routing(yaml.safe_load(text))
    assert table.aliases["chat"].cascade == ("small", "large")
    assert table.aliases["chat"].checks.refusal_regex is not None
    assert table.pools["small"].cost_per_hour == 2.0


def test_gateway_precise_routing_from_values(helm: str) -> None:
    docs = gateway_objects(template(helm, "gateway.enabled=true", "gateway.services={llama}",
                                    "gateway.prefixRouting=precise"))
    dep = next(d for d in docs if d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert config_from_args(args).routing == "precise"
    with pytest.raises(subprocess.CalledProcessError) as failed:
        template(helm, "gateway.enabled=true", "gateway.services={llama}",
                 "gateway.prefixRouting=exact")
    assert "prefixRouting must be approximate or precise" in failed.value.stderr


def test_gateway_disaggregation_from_values(helm: str) -> None:
    docs = gateway_objects(template(
        helm, "gateway.enabled=true", "gateway.services={llama}",
        "gateway.disaggregation.mode=always", "gateway.disaggregation.minPromptTokens=512",
        "gateway.disaggregation.prefillTimeoutSeconds=5"))
    dep = next(d for d in docs if d["kind"] == "Deployment")
    config = config_from_args(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (config.disaggregation, config.disaggregation_min_prompt_tokens,
            config.disaggregation_prefill_timeout_seconds) == ("always", 512, 5.0)
