"""Capacity inputs read from the model source (moto S3 and a mounted directory on loopback),
with the operator's client reading the credentials Secret from kmock; fallbacks and caching."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvasir_operator import k8s
from kvasir_operator.modelconfig import parse_config, weight_bytes
from kvasir_operator.modelprobe import ModelProbe
from kvasir_operator.spec import Architecture
from kvasir_operator.spec_parse import parse_spec
from operator_support import LLAMA_CONFIG, SHARDS, llama_files, secret

NS = "ns1"
SECRET_VALUE = "s3cr3t-never-logged"
LLAMA = Architecture(num_layers=32, num_kv_heads=8, head_dim=128, num_heads=32)


def _secret(kmock: Any, name: str = "creds", **data: str) -> None:
    kmock.resources["v1/secrets"] = kmock.ResourceInfo(kind="Secret", namespaced=True,
                                                       verbs={"get"})
    kmock.objects["v1/secrets", NS, name] = secret(name, NS, data)


def _spec(uri: str, endpoint: str | None = None, **model: Any) -> Any:
    fetch = {"endpointUrl": endpoint} if endpoint else {}
    return parse_spec("m", {"model": {"uri": uri, "credentialsSecret": "creds", **model},
                            "fetch": fetch})


@pytest.fixture()
def blackhole() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung S3 endpoint)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_parse_config_shapes() -> None:
    assert parse_config(json.dumps(LLAMA_CONFIG).encode()) == LLAMA
    gqa_free = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    assert parse_config(json.dumps(gqa_free).encode()) == Architecture(2, 4, 64, 4)
    vlm = {"text_config": {**LLAMA_CONFIG, "head_dim": 96}, "vision_config": {}}
    assert parse_config(json.dumps(vlm).encode()) == Architecture(32, 8, 96, 32)
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "num_key_value_heads": 128}
    assert parse_config(json.dumps(mla).encode()) == Architecture(61, 1, 288, 128)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        parse_config(b'{"num_attention_heads": 4}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_config(b"{")
    both = [("a.safetensors", 5), ("pytorch_model.bin", 7), ("tok.json", 1)]
    assert weight_bytes(both) == (5, 1)  # the engine loads the safetensors copy only
    assert weight_bytes([("m.Q4_K_M.gguf", 9), ("README.md", 1)]) == (9, 1)


@pytest.mark.asyncio
async def test_s3_source_with_secret_keys(kmock: Any, aws_env: None, upload: Any,
                                          moto_endpoint: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    uri = upload(llama_files())
    _secret(kmock, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY=SECRET_VALUE,
            AWS_ENDPOINT_URL=moto_endpoint)  # the endpoint may come from the Secret too
    probe = ModelProbe(timeout_seconds=10)
    async with k8s.K8sClient(str(kmock.url)) as client:
        facts = await probe.facts(client, NS, "m", 1, _spec(uri))
        assert (facts.from_source, facts.reason) == (True, "ReadFromSource")
        assert facts.weights_bytes == sum(SHARDS.values()) and facts.architecture == LLAMA
        assert "2 weight file(s), 500000 bytes" in facts.message
        # A timer tick at the same generation does not read the source again; a new one does.
        assert await probe.facts(client, NS, "m", 1, _spec(uri)) == facts and probe.reads == 1
        await probe.facts(client, NS, "m", 2, _spec(uri))
        assert probe.reads == 2
    assert not any(SECRET_VALUE in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_gguf_size_from_listing_arch_from_spec(kmock: Any, aws_env: None, upload: Any,
                                                     moto_endpoint: str) -> None:
    uri = upload({"llama-8b.Q4_K_M.gguf": bytes(123_456), "README.md": b"hi"})
    _secret(kmock, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
    spec = _spec(uri, moto_endpoint, architecture={"numLayers": 32, "numKVHeads": 8,
                                                   "headDim": 128})
    async with k8s.K8sClient(str(kmock.url)) as client:
        facts = await ModelProbe().facts(client, NS, "m", 1, spec)
    assert (facts.reason, facts.weights_bytes, facts.architecture) == (
        "SizeFromSource", 123_456, Architecture(32, 8, 128))  # the spec's, no head count
    assert "no config.json: architecture from spec.model.architecture" in facts.message


@pytest.mark.asyncio
async def test_fallbacks_name_the_reason(kmock: Any, aws_env: None, upload: Any,
                                         moto_endpoint: str, blackhole: str) -> None:
    uri = upload(llama_files())
    async with k8s.K8sClient(str(kmock.url)) as client:
        probe = ModelProbe(timeout_seconds=10)
        _secret(kmock, "other", AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
        missing = await probe.facts(client, NS, "a", 1, _spec(uri, moto_endpoint,
                                                               sizeBytes=42))
        assert (missing.from_source, missing.reason) == (False, "CredentialsUnreadable")
        assert missing.weights_bytes == 42 and "spec.model.sizeBytes (42)" in missing.message
        _secret(kmock, AWS_ACCESS_KEY_ID="k")
        partial = await probe.facts(client, NS, "b", 1, _spec(uri, moto_endpoint))
        assert partial.reason == "CredentialsMissing" and "AWS_SECRET_ACCESS_KEY" in (
            partial.message)
        _secret(kmock, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
        gone = await probe.facts(client, NS, "c", 1, _spec(uri + "-nope", moto_endpoint))
        assert gone.reason == "ModelNotFound"
        # A store that never answers: bounded by the timeout, then not retried at once.
        hung = ModelProbe(timeout_seconds=3, retry_after_seconds=300)
        slow = await hung.facts(client, NS, "d", 1, _spec(uri, blackhole))
        assert slow.reason == "SourceTimeout" and "within 3 s" in slow.message
        assert await hung.facts(client, NS, "d", 1, _spec(uri, blackhole)) == slow
        assert hung.reads == 1
        # Once read, a later generation's failed re-read keeps the known figures.
        good = await hung.facts(client, NS, "e", 1, _spec(uri, moto_endpoint))
        assert good.from_source
        assert await hung.facts(client, NS, "e", 2, _spec(uri, blackhole)) == good


@pytest.mark.asyncio
async def test_pvc_source_when_mounted(kmock: Any, tmp_path: Path) -> None:
    claim = tmp_path / "weights" / "llama"
    claim.mkdir(parents=True)
    for rel, data in llama_files().items():
        (claim / rel).write_bytes(data)
    probe = ModelProbe(pvc_root=str(tmp_path))
    async with k8s.K8sClient(str(kmock.url)) as client:
        facts = await probe.facts(client, NS, "m", 1, parse_spec(
            "m", {"model": {"uri": "pvc://weights/llama"}}))
        assert (facts.reason, facts.weights_bytes, facts.architecture) == (
            "ReadFromSource", 500_000, LLAMA)
        absent = await probe.facts(client, NS, "m", 1, parse_spec(
            "m", {"model": {"uri": "pvc://other/llama"}}))
        assert absent.reason == "SourceNotReachable" and "not mounted" in absent.message


@pytest.mark.asyncio
async def test_an_in_image_path_is_not_an_unreachable_source(kmock: Any) -> None:
    probe = ModelProbe()
    async with k8s.K8sClient(str(kmock.url)) as client:
        facts = await probe.facts(client, NS, "m", 1, parse_spec(
            "m", {"model": {"uri": "/models/smollm2-in-the-image"}}))
    assert facts.reason == "InImage" and "in the engine image" in facts.message
    assert not facts.from_source and probe.reads == 0
