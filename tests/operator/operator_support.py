"""Shared fixtures of the operator tests: a real moto S3 server on 127.0.0.1 holding models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import boto3
import pytest

# The Llama-3-8B attention geometry: 2 x 32 x 8 x 128 x 2 B = 131072 B of KV per token.
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                "torch_dtype": "bfloat16"}
SHARDS = {"model-00001-of-00002.safetensors": 300_000, "model-00002-of-00002.safetensors": 200_000}


@pytest.fixture()
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS settings from the outside and no instance-metadata lookups: loopback only."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


@pytest.fixture(scope="session")
def s3(moto_endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def llama_files() -> dict[str, bytes]:
    """config.json, the safetensors index, two shards (zeros: only sizes matter here)."""
    index = {"metadata": {"total_size": sum(SHARDS.values())},
             "weight_map": {"model.embed_tokens.weight": next(iter(SHARDS))}}
    return {"config.json": json.dumps(LLAMA_CONFIG).encode(),
            "model.safetensors.index.json": json.dumps(index).encode(),
            **{name: bytes(size) for name, size in SHARDS.items()}}


@pytest.fixture()
def upload(s3: Any) -> Any:
    def _upload(files: dict[str, bytes]) -> str:
        bucket = f"models-{uuid.uuid4().hex[:12]}"
        s3.create_bucket(Bucket=bucket)
        for rel, data in files.items():
            s3.put_object(Bucket=bucket, Key=f"llama/{rel}", Body=data)
        return f"s3://{bucket}/llama"

    return _upload


def serve_operator_resources(kmock: Any) -> None:
    """Register with kmock every resource the operator reads or writes."""
    from kvasir_operator import k8s

    info = kmock.ResourceInfo
    kmock.resources["kvasir.dev/v1alpha1/inferenceservices"] = info(
        kind="InferenceService", namespaced=True, subresources={"status", "scale"},
        verbs={"get", "list", "watch", "patch", "create", "delete"})
    for res in (k8s.DEPLOYMENTS, k8s.SERVICES, k8s.PDBS, k8s.PODS, k8s.EVENTS,
                k8s.SERVICEACCOUNTS, k8s.SECRETS):
        kmock.resources[f"{res.group}/{res.version}/{res.plural}".lstrip("/")] = info(
            kind=res.kind, namespaced=True,
            verbs={"get", "list", "watch", "patch", "create", "delete"})


def serve_operator_cluster(kmock: Any, namespaces: tuple[str, ...] = ("ns1", "ns2")) -> None:
    """What kopf needs besides the operator's resources to serve `--namespace`: namespaces (with
    kmock_namespaces.namespaces_served) and the CRD list."""
    info = kmock.ResourceInfo
    serve_operator_resources(kmock)
    kmock.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False,
                                            verbs={"get", "list", "watch"})
    for ns in namespaces:
        kmock.objects["v1/namespaces", None, ns] = {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch"})


WRITES = ("POST", "PUT", "PATCH", "DELETE")


def writes(kmock: Any, since: int) -> list[str]:
    """The writes kmock received since its `since`-th request, as "METHOD path"."""
    return [f"{r.method} {r.url.path}" for r in list(kmock)[since:] if r.method in WRITES]


async def reconcile_named(client: Any, namespace: str, name: str) -> None:
    """One reconcile of the InferenceService as the API server holds it now."""
    from kvasir_operator import k8s
    from kvasir_operator.reconcile import reconcile

    body = await client.get(k8s.INFERENCESERVICES, namespace, name)
    assert body is not None
    await reconcile(client, body)


def isvc(name: str, namespace: str, uid: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": 1,
                         "resourceVersion": "1"},
            "spec": spec}


def secret(name: str, namespace: str, data: dict[str, str]) -> dict[str, Any]:
    import base64

    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


async def until(what: str, probe: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
    """Poll `probe` every 0.1 s until it returns something truthy."""
    for _ in range(int(timeout / 0.1)):
        value = await probe()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def operator_running(settings: Any, namespace: str = "ns1",
                           memo: Any = None) -> AsyncIterator[None]:
    """The operator in this event loop, serving `namespace`, with `settings` in its memo (what
    main.py does), so a test injects its kubeconfig or service-account directory."""
    import kopf
    import kvasir_operator.handlers  # noqa: F401  (registers the handlers)

    if memo is not None:
        memo.settings = settings
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(kopf.operator(
        standalone=True, clusterwide=False, namespaces=[namespace],
        memo=memo if memo is not None else kopf.Memo(settings=settings), stop_flag=stop))
    try:
        yield
    finally:
        stop.set_result(None)
        await asyncio.wait_for(task, timeout=30)
