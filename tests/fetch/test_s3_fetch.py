"""kvasir-fetch against a real S3 endpoint (moto's server on loopback), through a recording proxy."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fetch_proxy import RecordingProxy
from fetch_support import assert_model, fetch_env, manifest_for, model_files, run_fetch

PART = "131072"  # 128 KiB: every shard spans several parts


def test_multi_file_model_downloads_in_parts_and_verifies(
    upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files())
    dest = tmp_path / "cache"
    result = run_fetch(
        model.uri, dest, "--endpoint-url", proxy.url, "--part-size", PART, "--concurrency", "4"
    )
    assert result.returncode == 0, result.stderr
    assert_model(dest, model.files)
    shard_gets = proxy.gets_of("model-00001-of-00002.safetensors")
    assert len(shard_gets) == -(-1_300_000 // 131072)  # ceil: one ranged GET per part
    assert all(get.range for get in shard_gets)
    assert "done:" in result.stderr and "files fetched 4, reused 0" in result.stderr
    marker = json.loads((dest / ".kvasir-complete.json").read_text())
    digest = (
        "sha256:"
        + hashlib.sha256(
            json.dumps(
                json.loads(manifest_for(model.files)), sort_keys=True, separators=(",", ":")
            ).encode()
        ).hexdigest()
    )
    assert marker["uri"] == model.uri and marker["manifestDigest"] == digest


def test_second_run_is_a_noop_without_data_gets(
    upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files())
    dest = tmp_path / "cache"
    assert run_fetch(model.uri, dest, "--endpoint-url", proxy.url).returncode == 0
    proxy.reset()
    again = run_fetch(model.uri, dest, "--endpoint-url", proxy.url)
    assert again.returncode == 0, again.stderr
    assert "(no-op)" in again.stderr
    data_gets = [
        r
        for r in proxy.requests
        if r.method == "GET"
        and not r.key.endswith("kvasir-manifest.json")
        and "list-type" not in r.path
    ]
    assert data_gets == []
    assert_model(dest, model.files)


def test_tampered_cache_file_is_fetched_again(
    upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files())
    dest = tmp_path / "cache"
    assert run_fetch(model.uri, dest, "--endpoint-url", proxy.url).returncode == 0
    shard = dest / "model-00002-of-00002.safetensors"
    shard.write_bytes(
        b"\0" * shard.stat().st_size
    )  # same size, new content: the marker must not trust it
    proxy.reset()
    again = run_fetch(model.uri, dest, "--endpoint-url", proxy.url)
    assert again.returncode == 0, again.stderr
    assert_model(dest, model.files)
    fetched_keys = {r.key.rsplit("/", 1)[-1] for r in proxy.ranged_gets()}
    assert fetched_keys == {"model-00002-of-00002.safetensors"}
    assert "reused 3" in again.stderr


def test_corrupted_object_fails_with_5_and_publishes_nothing(
    upload: Any, s3: Any, tmp_path: Path, moto_endpoint: str
) -> None:
    files = model_files()
    model = upload(files)
    bad = bytearray(files["model-00001-of-00002.safetensors"])
    bad[777_777] ^= 0xFF
    s3.put_object(
        Bucket=model.bucket, Key="llama/model-00001-of-00002.safetensors", Body=bytes(bad)
    )
    dest = tmp_path / "cache"
    result = run_fetch(model.uri, dest, "--endpoint-url", moto_endpoint, "--part-size", PART)
    assert result.returncode == 5, result.stderr
    assert (
        "ChecksumMismatch" in result.stderr and "model-00001-of-00002.safetensors" in result.stderr
    )
    assert len(result.stderr.strip().splitlines()[-1]) < 300
    published = [
        p.name
        for p in dest.rglob("*")
        if p.is_file() and not p.name.endswith((".part", ".part.json"))
    ]
    assert published == []
    assert not (dest / "model-00001-of-00002.safetensors.part").exists()


def test_missing_bucket_and_prefix_exit_3(moto_endpoint: str, upload: Any, tmp_path: Path) -> None:
    result = run_fetch(
        "s3://no-such-bucket-kvasir/llama", tmp_path / "a", "--endpoint-url", moto_endpoint
    )
    assert result.returncode == 3, result.stderr
    assert "NoSuchBucket" in result.stderr
    model = upload(model_files())
    result = run_fetch(
        f"s3://{model.bucket}/other", tmp_path / "b", "--endpoint-url", moto_endpoint
    )
    assert result.returncode == 3, result.stderr
    assert "no objects" in result.stderr


def test_manifest_naming_a_missing_object_exits_3(
    upload: Any, moto_endpoint: str, tmp_path: Path
) -> None:
    files = model_files()
    model = upload(
        {k: v for k, v in files.items() if k != "config.json"}, manifest=manifest_for(files)
    )
    result = run_fetch(model.uri, tmp_path / "c", "--endpoint-url", moto_endpoint)
    assert result.returncode == 3, result.stderr
    assert "config.json" in result.stderr


def test_stalled_body_exits_7(upload: Any, proxy: RecordingProxy, tmp_path: Path) -> None:
    model = upload(model_files())
    proxy.stall_after_bytes = 1000  # every body longer than this stops mid-way, socket left open
    result = run_fetch(
        model.uri,
        tmp_path / "d",
        "--endpoint-url",
        proxy.url,
        "--stall-timeout",
        "1",
        "--retries",
        "1",
        "--concurrency",
        "2",
        timeout=60,
    )
    assert result.returncode == 7, result.stderr
    assert "Stalled" in result.stderr and "stall timeout" in result.stderr
    shard = [g.range for g in proxy.gets_of("model-00001-of-00002.safetensors")]
    assert shard in ([], ["bytes=0-1299999"] * 2)  # when reached: one attempt + one retry
    assert not (tmp_path / "d" / "model-00001-of-00002.safetensors").exists()


def test_retry_after_a_stall_asks_only_for_the_missing_bytes(
    upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files())
    proxy.stall_after_bytes = 1024 * 1024 + 1000  # one full 1 MiB read arrives, then silence
    dest = tmp_path / "d"
    result = run_fetch(model.uri, dest, "--endpoint-url", proxy.url, "--stall-timeout", "1")
    assert result.returncode == 0, result.stderr
    assert_model(dest, model.files)
    shard = [g.range for g in proxy.gets_of("model-00001-of-00002.safetensors")]
    assert shard == ["bytes=0-1299999", "bytes=1048576-1299999"]


def test_throttled_gets_are_retried_with_backoff(
    upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files())
    proxy.throttle_ranged = 5  # more SlowDowns than --retries allows one part, spread over parts
    result = run_fetch(
        model.uri,
        tmp_path / "t",
        "--endpoint-url",
        proxy.url,
        "--part-size",
        PART,
        "--retries",
        "6",
        "--concurrency",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert_model(tmp_path / "t", model.files)
    parts = sum(-(-len(d) // int(PART)) for d in model.files.values())
    assert len(proxy.ranged_gets()) == parts + 5  # every SlowDown was followed by one retry


def test_persistent_throttling_gives_up_with_7(
    upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files())
    proxy.throttle_ranged = 10_000
    result = run_fetch(
        model.uri,
        tmp_path / "u",
        "--endpoint-url",
        proxy.url,
        "--retries",
        "2",
        "--concurrency",
        "1",
    )
    assert result.returncode == 7, result.stderr
    assert "SlowDown" in result.stderr
    assert len(proxy.ranged_gets()) == 3  # the first attempt and exactly two retries


def test_no_manifest_and_no_checksums_exits_8_unless_allowed(
    upload: Any, moto_endpoint: str, tmp_path: Path
) -> None:
    model = upload(model_files(), manifest=None)
    refused = run_fetch(model.uri, tmp_path / "e", "--endpoint-url", moto_endpoint)
    assert refused.returncode == 8, refused.stderr
    assert "--allow-unverified" in refused.stderr
    assert not (tmp_path / "e" / "config.json").exists()
    allowed = run_fetch(
        model.uri, tmp_path / "e", "--endpoint-url", moto_endpoint, "--allow-unverified"
    )
    assert allowed.returncode == 0, allowed.stderr
    assert_model(tmp_path / "e", model.files)
    env_allowed = run_fetch(
        model.uri,
        tmp_path / "f",
        env=fetch_env(
            KVASIR_FETCH_ALLOW_UNVERIFIED="true", KVASIR_FETCH_ENDPOINT_URL=moto_endpoint
        ),
    )
    assert env_allowed.returncode == 0, env_allowed.stderr


def test_s3_sha256_checksums_verify_without_manifest(
    upload: Any, moto_endpoint: str, tmp_path: Path
) -> None:
    model = upload(model_files(), manifest=None, ChecksumAlgorithm="SHA256")
    dest = tmp_path / "g"
    result = run_fetch(model.uri, dest, "--endpoint-url", moto_endpoint, "--part-size", PART)
    assert result.returncode == 0, result.stderr
    assert_model(dest, model.files)
    marker = json.loads((dest / ".kvasir-complete.json").read_text())
    assert marker["origin"] == "s3-checksums"
    assert all(
        f["sha256"] == hashlib.sha256(model.files[f["path"]]).hexdigest() for f in marker["files"]
    )


def test_env_options_and_path_addressing(
    upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files())
    env = fetch_env(
        AWS_ENDPOINT_URL=proxy.url,
        KVASIR_FETCH_PART_SIZE="256KiB",
        KVASIR_FETCH_ADDRESSING_STYLE="path",
        KVASIR_FETCH_CONCURRENCY="2",
    )
    result = run_fetch(model.uri, tmp_path / "h", env=env)
    assert result.returncode == 0, result.stderr
    assert_model(tmp_path / "h", model.files)
    assert len(proxy.gets_of("model-00001-of-00002.safetensors")) == -(-1_300_000 // 262144)
    assert all(r.key.startswith(f"/{model.bucket}") for r in proxy.requests)
    assert "testing" not in result.stderr  # credentials are never printed
