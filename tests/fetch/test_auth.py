"""Bad credentials against moto with its real IAM authentication switched on -> exit code 4."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from fetch_support import fetch_env, model_files, run_fetch


def _set_auth(endpoint: str, free_actions: str) -> None:
    """moto authenticates every request after `free_actions` unauthenticated ones ("inf": never)."""
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=free_actions.encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.fixture()
def iam_user_key(moto_endpoint: str) -> Iterator[tuple[str, str]]:
    """An IAM user with a real access key and no policy; auth enforced from then on."""
    iam = boto3.client(
        "iam",
        endpoint_url=moto_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    _set_auth(moto_endpoint, "2")  # exactly the two IAM calls below run unauthenticated
    try:
        iam.create_user(UserName="no-policy")
        key = iam.create_access_key(UserName="no-policy")["AccessKey"]
        yield key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        _set_auth(moto_endpoint, "inf")


def test_wrong_or_unauthorised_credentials_exit_4(
    upload: Any, moto_endpoint: str, iam_user_key: tuple[str, str], tmp_path: Path
) -> None:
    _set_auth(moto_endpoint, "inf")
    model = upload(model_files())
    _set_auth(moto_endpoint, "0")
    unknown = run_fetch(
        model.uri,
        tmp_path / "a",
        "--endpoint-url",
        moto_endpoint,
        "--retries",
        "0",
        env=fetch_env(AWS_ACCESS_KEY_ID="AKIAWRONGWRONGWRONG1", AWS_SECRET_ACCESS_KEY="nope"),
    )
    assert unknown.returncode == 4, unknown.stderr
    assert "AccessDenied: " in unknown.stderr and "InvalidAccessKeyId" in unknown.stderr

    key_id, secret = iam_user_key
    forbidden = run_fetch(
        model.uri,
        tmp_path / "b",
        "--endpoint-url",
        moto_endpoint,
        env=fetch_env(AWS_ACCESS_KEY_ID=key_id, AWS_SECRET_ACCESS_KEY=secret),
    )
    assert forbidden.returncode == 4, forbidden.stderr
    assert secret not in forbidden.stderr and key_id not in forbidden.stderr
    assert not (tmp_path / "b" / "config.json").exists()
