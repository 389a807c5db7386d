"""The one model-URI parser (fetch/uri.py), as the fetcher words its refusals (the operator's
wording is tested in tests/operator/test_spec_validation.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kvasir_operator.fetch import open_source
from kvasir_operator.fetch.errors import UsageError
from kvasir_operator.fetch.options import FetchOptions
from kvasir_operator.fetch.uri import ModelUri, parse_model_uri


@pytest.mark.parametrize(("uri", "parsed", "key_prefix"), [
    ("s3://bkt/llama/8b/", ModelUri("s3", "s3://bkt/llama/8b/", "bkt", "llama/8b/"), "llama/8b/"),
    ("s3://bkt", ModelUri("s3", "s3://bkt", "bkt", ""), ""),
    ("pvc://weights/llama", ModelUri("pvc", "pvc://weights/llama", "weights", "llama"), "llama/"),
    ("/opt/model", ModelUri("local", "/opt/model", "", "/opt/model"), "opt/model/"),
    ("relative/dir", ModelUri("local", "relative/dir", "", "relative/dir"), "relative/dir/"),
    ("/odd://name", ModelUri("local", "/odd://name", "", "/odd://name"), "odd://name/")])
def test_a_uri_names_one_place(uri: str, parsed: ModelUri, key_prefix: str) -> None:
    assert parse_model_uri(uri) == parsed
    assert parsed.key_prefix == key_prefix


@pytest.mark.parametrize(("uri", "message"), [
    ("s3://", "SOURCE 's3://': s3:// needs a bucket (s3://bucket/prefix)"),
    ("s3:///prefix", "SOURCE 's3:///prefix': s3:// needs a bucket (s3://bucket/prefix)"),
    ("pvc:///path", "SOURCE 'pvc:///path': pvc:// needs a claim name (pvc://claim/path)"),
    ("http://x", "SOURCE 'http://x': scheme must be s3://, pvc:// or a local path")])
def test_the_fetcher_refuses_a_uri_that_names_nothing(uri: str, message: str) -> None:
    with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
        open_source(uri)


def test_a_pvc_uri_is_read_under_the_claims_mount(tmp_path: Path) -> None:
    source = open_source("pvc://weights/llama/8b", FetchOptions(pvc_root=str(tmp_path)))
    assert source.uri == "pvc://weights/llama/8b"
    assert source.local_root == tmp_path / "weights" / "llama" / "8b"
