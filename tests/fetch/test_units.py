"""Pure pieces of the fetcher: range bookkeeping, manifest and option validation, CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fetch_support import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kvasir_operator.fetch.cli import parse_bytes
from kvasir_operator.fetch.errors import ChecksumMismatch, failure_line, report_failure
from kvasir_operator.fetch.manifest import (
    Manifest,
    ManifestFile,
    check_relative_path,
    parse_manifest,
)
from kvasir_operator.fetch.options import FetchOptions
from kvasir_operator.fetch.partfile import merge_ranges, split_missing

SHA = "ab" * 32


@given(
    size=st.integers(0, 5000),
    part=st.integers(1, 700),
    cuts=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 800)), max_size=12),
)
def test_missing_ranges_complement_done_ranges(
    size: int, part: int, cuts: list[tuple[int, int]]
) -> None:
    done = merge_ranges([(min(s, size), min(s + n, size)) for s, n in cuts])
    missing = split_missing(done, size, part)
    assert all(0 < e - s <= part for s, e in missing)
    assert merge_ranges(done + missing) == ([(0, size)] if size else [])
    assert sum(e - s for s, e in done + missing) == size  # no overlap, nothing fetched twice


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../b", "a//b", "./a", "a\\b", ""])
def test_manifest_paths_cannot_escape_dest(bad: str) -> None:
    with pytest.raises(ValueError, match="path"):
        check_relative_path(bad)


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"version": 2, "files": []}, "version"),
        ({"version": 1, "files": []}, "files"),
        ({"version": 1, "files": [{"path": "a", "size": "1", "sha256": SHA}]}, r"files\[0\].size"),
        ({"version": 1, "files": [{"path": "a", "size": 1, "sha256": "xyz"}]}, "sha256"),
        ({"version": 1, "files": [{"path": "../a", "size": 1, "sha256": SHA}]}, "path"),
        ({"version": 1, "files": [{"path": "a", "size": 1, "sha256": SHA}] * 2}, "unique"),
    ],
)
def test_bad_manifest_names_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_manifest(json.dumps(doc).encode())


def test_digest_ignores_key_order_and_whitespace() -> None:
    a = b'{"version": 1, "files": [{"path": "a", "size": 1, "sha256": "%s"}]}' % SHA.encode()
    b = b'{"files":[{"sha256":"%s","size":1,"path":"a"}],\n "version":1}' % SHA.upper().encode()
    assert parse_manifest(a).digest == parse_manifest(b).digest
    other = Manifest(files=(ManifestFile("a", 2, SHA),))
    assert other.digest != parse_manifest(a).digest


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"part_size": 1000}, "part_size"),
        ({"stall_timeout": 0}, "stall_timeout"),
        ({"retries": -1}, "retries"),
        ({"addressing_style": "dns"}, "addressing_style"),
        ({"endpoint_url": "localhost:9000"}, "endpoint_url"),
    ],
)
def test_options_validate_and_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FetchOptions(**kwargs)  # type: ignore[arg-type]


def test_parse_bytes_units() -> None:
    assert parse_bytes("8388608") == parse_bytes("8MiB") == parse_bytes("8mi") == 8 * 1024 * 1024
    assert parse_bytes("1G") == 10**9


@pytest.mark.parametrize(
    "argv",
    [
        ["s3://b/p", "/tmp/d", "--concurrency", "0"],
        ["s3://b/p", "/tmp/d", "--part-size", "lots"],
        ["s3://b/p", "/tmp/d", "--addressing-style", "dns"],
        ["gs://b/p", "/tmp/d"],
        [],
    ],
)
def test_cli_usage_errors_exit_2_with_one_line(argv: list[str]) -> None:
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("kvasir-fetch: InvalidConfig:")


def test_failure_goes_to_termination_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setenv("KVASIR_FETCH_TERMINATION_LOG", str(log))
    code = report_failure(ChecksumMismatch("model.safetensors: SHA-256\ndiffers"))
    assert code == 5
    line = "kvasir-fetch: ChecksumMismatch: model.safetensors: SHA-256 differs"
    assert log.read_text() == line + "\n"
    assert capsys.readouterr().err == line + "\n"
    assert failure_line(RuntimeError("boom")) == "kvasir-fetch: UnexpectedError: RuntimeError: boom"
