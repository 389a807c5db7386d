"""Fixtures for kvasir-fetch tests: a real moto S3 server on loopback, a recording proxy in
front of it, model uploads, and a helper that runs the real `kvasir-fetch` in a subprocess."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from fetch_proxy import RecordingProxy

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@pytest.fixture()
def proxy(moto_endpoint: str) -> Iterator[RecordingProxy]:
    recorder = RecordingProxy(int(moto_endpoint.rsplit(":", 1)[1])).start()
    yield recorder
    recorder.stop()


@pytest.fixture(scope="session")
def s3(moto_endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        region_name="us-east-1",
        aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"],
    )


@dataclasses.dataclass(frozen=True)
class Model:
    bucket: str
    prefix: str
    files: dict[str, bytes]

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def manifest_for(files: dict[str, bytes]) -> bytes:
    entries = [
        {"path": p, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
        for p, d in sorted(files.items())
    ]
    return json.dumps({"version": 1, "files": entries}).encode()


def model_files(seed: int = 0) -> dict[str, bytes]:
    """Two shards larger than the test part sizes, a small one in a subfolder, a config."""
    rng = random.Random(seed)
    return {
        "model-00001-of-00002.safetensors": rng.randbytes(1_300_000),
        "model-00002-of-00002.safetensors": rng.randbytes(700_001),
        "tokenizer/tokenizer.json": rng.randbytes(70_000),
        "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}',
    }


@pytest.fixture()
def upload(s3: Any) -> Any:
    def _upload(
        files: dict[str, bytes], *, manifest: bytes | None | bool = True, **put: Any
    ) -> Model:
        bucket = f"models-{uuid.uuid4().hex[:12]}"
        s3.create_bucket(Bucket=bucket)
        for rel, data in files.items():
            s3.put_object(Bucket=bucket, Key=f"llama/{rel}", Body=data, **put)
        if manifest is True:
            manifest = manifest_for(files)
        if manifest:
            s3.put_object(Bucket=bucket, Key="llama/kvasir-manifest.json", Body=manifest)
        return Model(bucket, "llama", files)

    return _upload


def fetch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KVASIR_FETCH_"))}
    env.update(CREDS, AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    env.pop("POD_NAME", None)
    env.pop("POD_NAMESPACE", None)
    env.update(extra)
    return env


def fetch_cmd(source: str, dest: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvasir_operator.fetch.cli", source, str(dest), *args]


def run_fetch(
    source: str, dest: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        fetch_cmd(source, dest, *args),
        env=env or fetch_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_model(dest: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (dest / rel).read_bytes() == data, rel
    leftovers = [p.name for p in dest.rglob("*") if p.name.endswith((".part", ".part.json"))]
    assert leftovers == []
    marker = json.loads((dest / ".kvasir-complete.json").read_text())
    assert {f["path"] for f in marker["files"]} == set(files)


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """`kvasir-fetch ARGV...` exactly as typed, e.g. `run_cli("manifest", DIR)`."""
    return subprocess.run(
        [sys.executable, "-m", "kvasir_operator.fetch.cli", *argv],
        env=fetch_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def run_manifest(directory: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("manifest", str(directory))
