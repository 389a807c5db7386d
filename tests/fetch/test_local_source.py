"""Local and pvc:// sources: verified copy, in-place verification, and `kvasir-fetch manifest`."""

from __future__ import annotations

import json
from pathlib import Path

from fetch_support import assert_model, model_files, run_fetch, run_manifest
from kvasir_operator.fetch import open_source, read_catalog
from kvasir_operator.fetch.options import FetchOptions


def _write_model(root: Path) -> dict[str, bytes]:
    files = model_files(seed=3)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_manifest_command_then_local_copy_and_noop(tmp_path: Path) -> None:
    src = tmp_path / "weights"
    files = _write_model(src)
    made = run_manifest(src)
    assert made.returncode == 0, made.stderr
    assert "wrote" in made.stderr and "sha256:" in made.stderr
    doc = json.loads((src / "kvasir-manifest.json").read_text())
    assert sorted(f["path"] for f in doc["files"]) == sorted(files)

    dest = tmp_path / "cache"
    copied = run_fetch(str(src), dest, "--part-size", "65536", "--concurrency", "3")
    assert copied.returncode == 0, copied.stderr
    assert_model(dest, files)
    again = run_fetch(str(src), dest)
    assert again.returncode == 0 and "(no-op)" in again.stderr


def test_local_source_without_manifest_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "weights"
    _write_model(src)
    result = run_fetch(str(src), tmp_path / "cache")
    assert result.returncode == 8, result.stderr


def test_pvc_uri_maps_under_pvc_root_and_detects_corruption(tmp_path: Path) -> None:
    root = tmp_path / "pvcs"
    src = root / "claim-a" / "models" / "llama"
    files = _write_model(src)
    assert run_manifest(src).returncode == 0
    good = run_fetch("pvc://claim-a/models/llama", tmp_path / "cache", "--pvc-root", str(root))
    assert good.returncode == 0, good.stderr
    assert_model(tmp_path / "cache", files)

    (src / "config.json").write_bytes(b'{"architectures": ["EvilForCausalLM"], "hidden_size": 6}')
    bad = run_fetch("pvc://claim-a/models/llama", tmp_path / "cache2", "--pvc-root", str(root))
    assert bad.returncode == 5, bad.stderr
    assert not (tmp_path / "cache2" / "config.json").exists()


def test_in_place_verification_when_dest_is_the_source(tmp_path: Path) -> None:
    src = tmp_path / "weights"
    _write_model(src)
    assert run_manifest(src).returncode == 0
    ok = run_fetch(str(src), src)
    assert ok.returncode == 0, ok.stderr
    assert (src / ".kvasir-complete.json").exists()
    (src / "tokenizer" / "tokenizer.json").write_bytes(b"x" * 70_000)
    (src / ".kvasir-complete.json").unlink()
    bad = run_fetch(str(src), src)
    assert bad.returncode == 5, bad.stderr


def test_operator_api_reads_sizes_digest_and_config(tmp_path: Path) -> None:
    src = tmp_path / "weights"
    files = _write_model(src)
    source = open_source(str(src), FetchOptions(allow_unverified=True))
    catalog = read_catalog(source, allow_unverified=True)
    assert catalog.manifest.total_bytes == sum(len(d) for d in files.values())
    assert catalog.manifest.origin == "unverified"
    assert json.loads(source.read_small("config.json") or b"")["hidden_size"] == 64
