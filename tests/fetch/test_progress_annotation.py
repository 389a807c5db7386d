"""The pod annotation `kvasir.dev/fetch-progress`, written to a Kubernetes API (kmock on loopback).

The fetcher runs as a real subprocess with POD_NAME/POD_NAMESPACE (the downward API) and a
kubeconfig pointing at kmock; the test reads back every PATCH the emulated API server received.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import kmock
import pytest
from fetch_proxy import RecordingProxy
from fetch_support import fetch_cmd, fetch_env, model_files

ANNOTATION = "kvasir.dev/fetch-progress"
PODS = kmock.resource("", "v1", "pods")


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "sa", "user": {"token": "in-pod-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "sa"}}],
            }
        )
    )
    return path


async def _run(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    return proc.returncode or 0, err.decode()


def _pod_env(kmock: Any, pod: str, kubeconfig: Path, server: str | None = None) -> dict[str, str]:
    """Create the pod in kmock; the env its initContainer sees (downward API + kubeconfig)."""
    kmock.objects[PODS, "serving", pod] = {"metadata": {"name": pod, "namespace": "serving"}}
    config = _kubeconfig(kubeconfig, server or str(kmock.url))
    return fetch_env(POD_NAME=pod, POD_NAMESPACE="serving", KUBECONFIG=str(config))


def _progress_patches(api: Any) -> list[dict[str, Any]]:
    found = []
    for request in api:  # kmock iterates over the requests it received
        if request.method == "PATCH" and request.resource == PODS:
            found.append(json.loads(request.data["metadata"]["annotations"][ANNOTATION]))
    return found


@pytest.mark.asyncio
async def test_progress_is_patched_onto_the_pod(
    kmock: Any, upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files())
    proxy.range_delay_s = 0.03  # ~40 parts at concurrency 1: long enough for several reports
    env = _pod_env(kmock, "llama-0", tmp_path / "kubeconfig")
    cmd = fetch_cmd(
        model.uri,
        tmp_path / "cache",
        "--endpoint-url",
        proxy.url,
        "--part-size",
        "65536",
        "--concurrency",
        "1",
        "--progress-interval",
        "0.2",
    )
    code, stderr = await _run(cmd, env)
    assert code == 0, stderr

    patches = _progress_patches(kmock)
    assert [p["phase"] for p in patches].count("Downloading") >= 2
    final = patches[-1]
    total = sum(len(d) for d in model.files.values())
    assert final["phase"] == "Done"
    assert final["bytesDone"] == final["bytesTotal"] == total
    assert final["filesDone"] == final["filesTotal"] == 4
    assert final["manifestDigest"].startswith("sha256:")
    assert set(final) == {
        "phase",
        "bytesDone",
        "bytesTotal",
        "bytesPerSecond",
        "etaSeconds",
        "filesDone",
        "filesTotal",
        "message",
        "manifestDigest",
    }
    done_bytes = [p["bytesDone"] for p in patches]
    assert done_bytes == sorted(done_bytes)  # progress never goes backwards
    stored = kmock.objects[PODS, "serving", "llama-0"]
    assert json.loads(stored["metadata"]["annotations"][ANNOTATION])["phase"] == "Done"


@pytest.mark.asyncio
async def test_failed_fetch_reports_failed_and_unreachable_api_never_fails(
    kmock: Any, upload: Any, moto_endpoint: str, tmp_path: Path
) -> None:
    missing = fetch_cmd(
        "s3://no-such-bucket-kvasir/x", tmp_path / "a", "--endpoint-url", moto_endpoint
    )
    env = _pod_env(kmock, "llama-1", tmp_path / "kc")
    code, _ = await _run(missing, env)
    assert code == 3
    last = _progress_patches(kmock)[-1]
    assert last["phase"] == "Failed" and "NoSuchBucket" in last["message"]

    model = upload(model_files())
    dead_api = _pod_env(kmock, "llama-1", tmp_path / "dead", server="http://127.0.0.1:9")
    code, stderr = await _run(
        fetch_cmd(model.uri, tmp_path / "b", "--endpoint-url", moto_endpoint), dead_api
    )
    assert code == 0, stderr
    assert stderr.count("cannot annotate pod serving/llama-1") == 1
