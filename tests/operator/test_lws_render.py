"""Pipeline-parallel services render a LeaderWorkerSet (issue 21, the operator's half).

Every rendered LeaderWorkerSet is checked against the LWS API's structural schema
(lws_schema.py: unknown fields refused) and its pod templates against the real PodTemplateSpec
of every supported Kubernetes version (kubernetes-validate, strict). Around it: the CRD admits
and defaults the field, the parser names the field when it is wrong, a spec without it renders
the same Deployment (same spec hash) as before, the capacity check counts every stage's GPUs,
the rendezvous timeout covers the slowest pod's fetch, and the oldest LWS release that works is
stated in the chart, the docs and the missing-API message.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import yaml
from crd_schema import ROOT, admit, isvc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubeval import CHART_YAML, errors, supported_versions
from kvasir_operator import labels
from kvasir_operator.capacity import GIB, check_capacity
from kvasir_operator.pod import (
    FETCH_BYTES_PER_SECOND,
    MASTER_PORT,
    MIN_RENDEZVOUS_SECONDS,
    rendezvous_timeout_seconds,
    startup_budget_seconds,
)
from kvasir_operator.reconcile import LWS_API_MISSING_MESSAGE
from kvasir_operator.render import (
    Owner,
    render_deployment,
    render_pdb,
    render_service,
    render_workload,
)
from kvasir_operator.spec import Architecture, SpecError, spec_hash
from kvasir_operator.spec_parse import parse_spec
from lws_schema import lws_errors
from test_render import specs

OWNER = Owner("llm", "ns1", "uid-1")
VERSIONS = tuple(supported_versions())
PP = {"model": {"uri": "s3://models/llama-405b", "credentialsSecret": "s3-creds",
                "sizeBytes": 800 * 10**9},
      "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2, "maxModelLen": 16384},
      "cache": {"type": "hostPath", "path": "/mnt/nvme/kvasir"},
      "autoscaling": {"minReplicas": 1, "maxReplicas": 3}, "replicas": 2}


def _lws(raw: dict[str, Any]) -> dict[str, Any]:
    spec = parse_spec(OWNER.name, raw)
    return render_workload(spec, OWNER, spec_hash(spec), 16 * 10**9, "kvasir-engine")


def _engine(template: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == labels.ENGINE_CONTAINER)


def test_the_crd_defaults_the_field_to_one_and_refuses_what_is_out_of_range() -> None:
    stored, problems = admit(isvc({"model": {"uri": "s3://bkt/m"}}))
    assert problems == [] and stored["spec"]["engine"]["pipelineParallelSize"] == 1
    for bad in (0, 65, "2"):
        _, problems = admit(isvc({"model": {"uri": "s3://bkt/m"},
                                  "engine": {"pipelineParallelSize": bad}}))
        assert problems and "pipelineParallelSize" in " ".join(problems), (bad, problems)
    assert admit(isvc(PP, name="llm"))[1] == []


@pytest.mark.parametrize(("raw", "name", "message"), [
    ({"pipelineParallelSize": 0}, "llm", "spec.engine.pipelineParallelSize: must be in [1, 64]"),
    ({"pipelineParallelSize": "2"}, "llm", "spec.engine.pipelineParallelSize: must be an integer"),
    ({"pipelineParallelSize": True}, "llm", "spec.engine.pipelineParallelSize: must be an integer"),
    ({"pipelineParallelSize": 2}, "llama.3", "metadata.name: 'llama.3' must be a DNS-1035 label"),
    ({"pipelineParallelSize": 2}, "a" * 41, "of at most 40 characters"),
])
def test_the_parser_names_the_field(raw: dict[str, Any], name: str, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_spec(name, {"model": {"uri": "s3://bkt/m"}, "engine": raw})
    # A dotted name is fine for a Deployment: the check is only for a LeaderWorkerSet.
    assert parse_spec("llama.3", {"model": {"uri": "s3://bkt/m"}}).num_nodes == 1


def test_one_stage_renders_the_same_deployment_as_before() -> None:
    before = parse_spec("llm", {"model": {"uri": "s3://bkt/m"}})
    explicit = parse_spec("llm", {"model": {"uri": "s3://bkt/m"},
                                  "engine": {"pipelineParallelSize": 1}})
    assert spec_hash(before) == spec_hash(explicit)  # an operator upgrade rolls no pod
    dep = render_workload(explicit, OWNER, spec_hash(explicit))
    assert dep == render_deployment(before, OWNER, spec_hash(before))
    args = _engine(dep["spec"]["template"])["args"]
    assert "--pipeline-parallel-size" not in args and "--nnodes" not in args
    assert render_service(explicit, OWNER)["spec"]["selector"] == labels.selector_labels("llm")
    assert labels.selector_string("llm") == "kvasir.dev/inferenceservice=llm"


def test_the_leaderworkerset_is_valid_and_shaped_for_a_pipeline() -> None:
    lws = _lws(PP)
    assert lws_errors(lws, VERSIONS) == []
    assert lws["metadata"]["name"] == "llm-lws"  # not the Service's name: LWS makes its own
    assert lws["metadata"]["ownerReferences"] == [OWNER.reference]
    spec = lws["spec"]
    assert spec["replicas"] == 2  # groups, not pods
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    for template in (leader, worker):
        pod = template["spec"]
        engine = _engine(template)
        # Every pod fetches the weights into its own node-local cache and mounts it.
        # A hostPath cache: its root is given to uid 1000 first, then the fetch writes it.
        owner, fetch = pod["initContainers"]
        assert owner["name"] == "cache-owner" and fetch["name"] == labels.FETCH_CONTAINER
        assert fetch["args"][0] == "s3://models/llama-405b"
        assert {"name": "cache", "hostPath": {"path": "/mnt/nvme/kvasir",
                                              "type": "DirectoryOrCreate"}} in pod["volumes"]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "8"  # T GPUs per stage
        args = engine["args"]
        flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
        assert flags["--tensor-parallel-size"] == "8"
        assert flags["--pipeline-parallel-size"] == "2"
        assert flags["--nnodes"] == "$(LWS_GROUP_SIZE)"
        assert flags["--node-rank"] == "$(LWS_WORKER_INDEX)"
        assert flags["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
        assert flags["--master-port"] == str(MASTER_PORT)
        assert template["metadata"]["labels"][labels.SPEC_HASH] == spec_hash(
            parse_spec("llm", PP))
    lead, work = _engine(leader), _engine(worker)
    assert lead["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert lead["ports"][0]["containerPort"] == labels.HTTP_PORT
    # Workers serve no HTTP: no port, no probe; they outlive the leader's drain.
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & set(work)
    assert work["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(10 + 30)]
    assert lead["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]


def _flag(container: dict[str, Any], name: str) -> str:
    args = container["args"]
    assert args.count(name) == 1, args
    return str(args[args.index(name) + 1])


def test_the_rendezvous_waits_for_the_slowest_fetch_and_the_leaders_probe_for_it() -> None:
    """Each pod fetches the whole model before its engine starts: the nodes wait for each
    other as long as a cold-cache download takes at the assumed throughput, never less than
    the engine's 300 s; the leader's startup probe also covers that wait."""
    weights = 16 * 10**9
    wait = MIN_RENDEZVOUS_SECONDS + weights // FETCH_BYTES_PER_SECOND
    assert wait == 300 + 320
    group = _lws(PP)["spec"]["leaderWorkerTemplate"]
    leader, worker = _engine(group["leaderTemplate"]), _engine(group["workerTemplate"])
    assert _flag(leader, "--rendezvous-timeout") == _flag(worker, "--rendezvous-timeout") \
        == str(wait)
    spec = parse_spec("llm", PP)
    budget = startup_budget_seconds(spec, weights)
    assert budget == 16 + 120 + wait  # load at 1 GB/s, the overhead, then the wait
    assert leader["startupProbe"]["failureThreshold"] == math.ceil(budget / 10)
    # Without the inspected size, the spec's: 800 GB at 50 MB/s.
    assert rendezvous_timeout_seconds(spec, None) == 300 + 16_000
    # Nothing to fetch, or no size known: the engine's default.
    for model in ({"uri": "/models/llama"}, {"uri": "s3://models/llama"}):
        other = parse_spec("llm", {**PP, "model": model})
        assert rendezvous_timeout_seconds(other, None) == MIN_RENDEZVOUS_SECONDS
    # One pod waits for no one: no flag, and the probe's budget is the load alone.
    alone = parse_spec("llm", {**PP, "engine": {"tensorParallelSize": 8}})
    assert "--rendezvous-timeout" not in _engine(
        render_workload(alone, OWNER, spec_hash(alone), weights)["spec"]["template"])["args"]
    assert startup_budget_seconds(alone, weights) == 16 + 120
    # engine.extraArgs come last, so a user's own --rendezvous-timeout wins.
    raw = copy.deepcopy(PP)
    raw["engine"]["extraArgs"] = ["--rendezvous-timeout", "7200"]
    args = _engine(_lws(raw)["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["args"]
    assert args[-2:] == ["--rendezvous-timeout", "7200"]


def test_the_oldest_leaderworkerset_that_works_is_stated_where_users_look() -> None:
    """LWS_WORKER_INDEX, which every pod's --node-rank reads, came with LWS v0.6.0."""
    floor = labels.LWS_MIN_RELEASE
    chart = yaml.safe_load(CHART_YAML.read_text())
    assert chart["annotations"]["kvasir.dev/leaderworkerset-min-version"] == floor == "v0.6.0"
    notes = (CHART_YAML.parent / "templates" / "NOTES.txt").read_text()
    assert '"kvasir.dev/leaderworkerset-min-version" }} or newer' in notes
    assert f"LeaderWorkerSet {floor} or newer" in (ROOT / "docs" / "operator.md").read_text()
    assert f"install LeaderWorkerSet {floor} or newer" in LWS_API_MISSING_MESSAGE


def test_the_service_and_the_budget_count_groups() -> None:
    spec = parse_spec("llm", PP)
    selector = render_service(spec, OWNER)["spec"]["selector"]
    assert selector == {labels.INFERENCESERVICE: "llm", labels.LWS_WORKER_INDEX: "0"}
    assert labels.selector_string("llm", True) == (
        "kvasir.dev/inferenceservice=llm,leaderworkerset.sigs.k8s.io/worker-index=0")
    pdb = render_pdb(spec, OWNER)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == labels.selector_labels("llm")
    for obj in (render_service(spec, OWNER), pdb):
        assert errors(obj, VERSIONS[-1]) == []


def test_the_schema_refuses_what_an_api_server_would() -> None:
    """The check is real: misspelled, misplaced and out-of-range fields fail it."""
    lws = _lws(PP)
    cases: list[tuple[str, Any]] = [
        ("spec.leaderWorkerTemplate.sise", 2), ("spec.groups", 2),
        ("spec.leaderWorkerTemplate.size", 0), ("spec.leaderWorkerTemplate.restartPolicy", "Always"),
        ("spec.replicas", "2"), ("spec.rolloutStrategy.rollingUpdateConfiguration.maxSurge", 0),
        ("spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.readyProbe", {}),
    ]
    for path, value in cases:
        broken = copy.deepcopy(lws)
        *parents, last = path.split(".")
        node: Any = broken
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
        assert lws_errors(broken), path
    del lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert lws_errors(lws)


def test_capacity_counts_the_gpus_of_every_stage() -> None:
    raw = copy.deepcopy(PP)
    raw["resources"] = {"gpuType": "H100-80GB"}
    arch = Architecture(num_layers=126, num_kv_heads=8, head_dim=128)
    report = check_capacity(parse_spec("llm", raw), 750 * GIB, arch)
    assert report is not None and report.num_gpus == 16 and report.fits
    one_stage = copy.deepcopy(raw)
    one_stage["engine"]["pipelineParallelSize"] = 1
    alone = check_capacity(parse_spec("llm", one_stage), 750 * GIB, arch)
    assert alone is not None and alone.num_gpus == 8 and not alone.fits


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=specs(), num_stages=st.integers(2, 8))
def test_every_pipeline_spec_renders_a_valid_leaderworkerset(raw: dict[str, Any],
                                                             num_stages: int) -> None:
    raw["engine"]["pipelineParallelSize"] = num_stages
    assert admit(isvc(raw, name="llm"))[1] == []
    lws = _lws(raw)
    assert lws_errors(lws, (VERSIONS[0], VERSIONS[-1])) == []
    spec = parse_spec("llm", raw)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == num_stages
    assert lws["spec"]["replicas"] == spec.desired_replicas
