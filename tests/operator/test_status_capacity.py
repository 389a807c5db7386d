"""Status derivation from observed pods/events and the capacity arithmetic."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvasir_operator import labels
from kvasir_operator.capacity import GIB, check_capacity, gpu_memory_bytes
from kvasir_operator.reconcile import Children, plan
from kvasir_operator.spec import Architecture
from kvasir_operator.spec_parse import parse_spec
from kvasir_operator.status import Observed, derive_status, with_apply_failures


def _pod(init: dict[str, Any] | None = None, annotations: dict[str, str] | None = None,
         conditions: list[dict[str, Any]] | None = None,
         containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p", "annotations": annotations or {}},
            "status": {"initContainerStatuses": [{"name": "kvasir-fetch", **(init or {})}],
                       "containerStatuses": containers or [], "conditions": conditions or []}}


def _derive(pods: list[dict[str, Any]], events: list[dict[str, Any]] | None = None,
            ready: int = 0, desired: int = 1) -> dict[str, Any]:
    dep = {"status": {"replicas": desired, "readyReplicas": ready, "updatedReplicas": desired}}
    return derive_status(Observed(deployment=dep, pods=pods, events=events or []),
                         desired=desired, generation=3, is_local_model=False,
                         gpu_resource="nvidia.com/gpu", old={})


def _cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


@pytest.mark.parametrize(("code", "reason"), [(5, "ChecksumMismatch"), (1, "DownloadFailed"),
                                              (4, "AccessDenied"), (3, "ModelNotFound")])
def test_fetch_exit_codes_become_reasons(code: int, reason: str) -> None:
    pod = _pod(init={"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": {
        "terminated": {"exitCode": code, "message": "model.safetensors: sha256 abc != def"}}})
    st = _derive([pod])
    assert st["phase"] == "Failed" and st["reason"] == reason
    mr = _cond(st, "ModelReady")
    assert (mr["status"], mr["reason"]) == ("False", reason)
    assert "sha256 abc != def" in mr["message"] and f"exited {code}" in mr["message"]


def test_insufficient_gpu_from_scheduling_and_image_pull() -> None:
    unsched = _pod(conditions=[{"type": "PodScheduled", "status": "False",
                                "message": "0/3 nodes: 3 Insufficient nvidia.com/gpu."}])
    # Waiting for a GPU is Pending (as a Deployment's pods are), not Failed: it starts by itself.
    waiting = _derive([unsched])
    assert (waiting["phase"], waiting["reason"]) == ("Pending", "InsufficientGPU")
    ready = _cond(waiting, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InsufficientGPU")
    event = {"reason": "FailedScheduling", "message": "2 Insufficient nvidia.com/gpu"}
    by_event = _derive([_pod()], [event])
    assert _cond(by_event, "Progressing")["reason"] == "InsufficientGPU"
    assert by_event["phase"] == "Pending"
    # With some replicas ready, the missing GPU for one more is Degraded.
    assert _derive([unsched], ready=1, desired=2)["phase"] == "Degraded"
    pull = _pod(containers=[{"name": "engine", "image": "bad:1",
                             "state": {"waiting": {"reason": "ErrImagePull"}}}])
    assert (_derive([pull])["phase"], _derive([pull])["reason"]) == ("Failed", "ImagePullBackOff")


def test_progress_annotation_becomes_download_and_digest() -> None:
    running = {"phase": "Downloading", "bytesDone": 10, "bytesTotal": 100, "message": "10%"}
    done = {"phase": "Done", "bytesDone": 100, "bytesTotal": 100, "manifestDigest": "sha256:ab"}
    st = _derive([_pod(annotations={labels.FETCH_PROGRESS: json.dumps(running)}),
                  _pod(annotations={labels.FETCH_PROGRESS: json.dumps(done)})])
    assert st["download"] == running and st["modelDigest"] == "sha256:ab"
    assert _cond(st, "ModelReady")["status"] == "True"
    ready = _derive([_pod(init={"state": {"terminated": {"exitCode": 0}}})], ready=1)
    assert ready["phase"] == "Ready" and _cond(ready, "Available")["status"] == "True"
    assert _cond(ready, "Ready")["status"] == "True"


def test_capacity_arithmetic_and_refusal() -> None:
    assert gpu_memory_bytes("NVIDIA-H100-80GB-HBM3") == 80 * GIB
    llama8b = Architecture(num_layers=32, num_kv_heads=8, head_dim=128)
    spec = parse_spec("m", {"model": {"uri": "s3://bkt/m"}, "engine": {"maxModelLen": 8192},
                            "resources": {"gpuType": "L4"}})
    report = check_capacity(spec, 16 * 10**9, llama8b)
    assert report is not None
    assert report.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    usable = int(24 * GIB * 0.9)
    assert report.usable_bytes == usable
    assert report.num_sequences_fit == (usable - 16 * 10**9) // (131072 * 8192) == 6
    assert report.fits and "131072 B/token" in report.message
    too_big = check_capacity(spec, 30 * 10**9, llama8b)
    assert too_big is not None and not too_big.fits and "weights do not fit" in too_big.message
    assert check_capacity(parse_spec("m", {"model": {"uri": "s3://bkt/m"}}), 1, llama8b) is None


def test_plan_refuses_a_model_that_cannot_fit_before_rendering() -> None:
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"uri": "s3://bkt/m", "sizeBytes": 200 * 10**9,
                               "architecture": {"numLayers": 80, "numKVHeads": 8,
                                                "headDim": 128}},
                     "engine": {"maxModelLen": 8192}, "resources": {"gpuType": "A100-80GB"}}}
    the_plan = plan(body, Children())
    assert the_plan.apply == ()
    cond = _cond(the_plan.status, "CapacityFits")
    assert cond["status"] == "False" and "weights do not fit" in cond["message"]
    assert [e[1] for e in the_plan.events] == ["InsufficientGPUMemory"]
    again = plan({**body, "status": the_plan.status_patch}, Children())
    assert again.events == () and again.status_patch is None  # written only when changed


# Specs that would reach GPUs and crash-loop there (issue 35): refused before anything is
# rendered, Ready=False InvalidSpec, one Warning Event per distinct message.
_SIX_HEADS = {"numLayers": 30, "numKVHeads": 3, "headDim": 64, "numAttentionHeads": 6}
BAD_SPECS = [
    ("tp does not divide the heads", {"architecture": _SIX_HEADS},
     {"tensorParallelSize": 4}, {"gpus": 4}, "must divide the model's 6 attention heads"),
    ("tp does not divide the KV heads",
     {"architecture": {**_SIX_HEADS, "numAttentionHeads": 12, "numKVHeads": 6}},
     {"tensorParallelSize": 4}, {"gpus": 4}, "must divide the model's 6 KV heads"),
    ("tp not a multiple of the KV heads",
     {"architecture": {**_SIX_HEADS, "numAttentionHeads": 12, "numKVHeads": 3}},
     {"tensorParallelSize": 4}, {"gpus": 4}, "must divide the model's 3 KV heads"),
    ("int8 on a GPU", {}, {"quantization": "int8"}, {"gpus": 1},
     "runs on CPU engines only"),
    ("int4 across processes", {}, {"quantization": "int4", "pipelineParallelSize": 2},
     {"gpus": 0}, "runs in one CPU process"),
]


@pytest.mark.parametrize(("case", "model", "engine", "resources", "message"), BAD_SPECS,
                         ids=[c[0] for c in BAD_SPECS])
def test_bad_specs_are_refused_before_any_gpu(case: str, model: dict[str, Any],
                                              engine: dict[str, Any],
                                              resources: dict[str, Any], message: str) -> None:
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"uri": "s3://bkt/m", **model}, "engine": engine,
                     "resources": resources}}
    the_plan = plan(body, Children())
    assert the_plan.apply == (), case
    ready = _cond(the_plan.status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec", ready
    assert message in ready["message"], ready
    assert [(e[0], e[1]) for e in the_plan.events] == [("Warning", "InvalidSpec")]
    again = plan({**body, "status": the_plan.status_patch}, Children())
    assert again.events == () and again.status_patch is None  # one Event, one write


def test_a_layout_the_model_allows_is_rendered() -> None:
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"uri": "s3://bkt/m", "architecture": {
                **_SIX_HEADS, "numAttentionHeads": 12, "numKVHeads": 2}},
                     "engine": {"tensorParallelSize": 4}, "resources": {"gpus": 4}}}
    assert plan(body, Children()).apply  # 12 heads / 4; 2 KV heads, each on 2 ranks


def test_an_engine_crash_loop_is_a_warning_event_once() -> None:
    """Issue 35: EngineCrashLoop set the status but posted no Event (`kubectl describe` was
    silent). One Warning per distinct message; the next reconcile with the same loop posts none."""
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"uri": "s3://bkt/m"}, "resources": {"gpus": 1}}}
    crashing = _pod(containers=[{"name": "engine", "image": "kvasir-engine:dev",
                                 "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                 "lastState": {"terminated": {
                                     "exitCode": 2, "message": "--max-model-len too large"}}}])
    children = Children(pods=(crashing,))
    first = plan(body, children)
    warnings = [e for e in first.events if e[0] == "Warning"]
    assert warnings == [("Warning", "EngineCrashLoop", "--max-model-len too large")]
    again = plan({**body, "status": first.status}, children)
    assert [e for e in again.events if e[0] == "Warning"] == []


def test_a_failed_apply_is_never_phase_ready() -> None:
    ready = {"phase": "Ready", "reason": None, "conditions": []}
    status = with_apply_failures(ready, [("Service m", 500, "etcd timed out")], {}, 1)
    assert (status["phase"], status["reason"]) == ("Degraded", "ApplyFailed")
