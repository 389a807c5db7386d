"""The S3 (and S3-compatible) source: listing, small reads, ranged GETs, SHA-256 checksums.

Credentials come from boto3's default chain only (env or a mounted Secret as AWS_* variables,
IRSA / workload identity web-identity tokens, instance profiles), so the fetcher never handles,
logs or prints a secret itself. botocore retries listing and HEAD requests on throttling; the
ranged GETs are retried by the transfer loop, which also sees errors in the middle of a body.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .errors import NotFound, UsageError
from .manifest import check_relative_path, is_scratch
from .objects import ByteStream, ObjectInfo
from .options import FetchOptions
from .retry import client_error_code, translate
from .uri import ModelUri


def make_client(options: FetchOptions, retries: int,
                credentials: Mapping[str, str] | None = None) -> Any:
    config = Config(
        retries={"max_attempts": retries, "mode": "standard"},  # botocore counts retries here
        connect_timeout=min(options.stall_timeout, 30.0),
        # A socket that delivers nothing for this long raises ReadTimeoutError: the stall timeout.
        read_timeout=options.stall_timeout,
        max_pool_connections=options.concurrency + 4,
        s3={"addressing_style": options.addressing_style},
        # Ranged GETs cannot be validated against a full-object checksum; we hash the whole file.
        response_checksum_validation="when_required",
    )
    return boto3.session.Session(**(credentials or {})).client(
        "s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config
    )


class S3Source:
    def __init__(self, location: ModelUri, options: FetchOptions,
                 credentials: Mapping[str, str] | None = None) -> None:
        """`location`: an s3:// URI, parsed (uri.py)."""
        self.uri = location.uri.rstrip("/")
        self.local_root: Path | None = None
        self.bucket, self.prefix = location.authority, location.key_prefix
        try:
            self._client = make_client(options, options.retries, credentials)
            # Ranged GETs get exactly one attempt per call: the transfer loop retries them (it
            # also sees failures mid-body), and two retry layers would multiply the attempts.
            self._data_client = make_client(options, 0, credentials)
        except (BotoCoreError, ValueError) as exc:
            raise UsageError(f"S3 client configuration: {exc}") from exc

    def _url(self, rel: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{rel}"

    def list_objects(self) -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                for entry in page.get("Contents", []):
                    rel = str(entry["Key"])[len(self.prefix) :]
                    if not rel or rel.endswith("/") or is_scratch(rel):
                        continue
                    try:
                        check_relative_path(rel)
                    except ValueError:
                        continue  # keys like "a//b" cannot be placed on a filesystem; not ours
                    found.append(
                        ObjectInfo(path=rel, size=int(entry["Size"]), etag=entry.get("ETag"))
                    )
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, f"LIST {self._url()}") from exc
        if not found:
            raise NotFound(f"LIST {self._url()}: no objects under this prefix")
        return found

    def read_small(self, path: str, limit: int = 16 * 1024 * 1024) -> bytes | None:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self.prefix + path)
            if int(response["ContentLength"]) > limit:
                response["Body"].close()
                raise UsageError(f"{self._url(path)} is larger than {limit} bytes")
            return bytes(response["Body"].read())
        except ClientError as exc:
            if client_error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise translate(exc, f"GET {self._url(path)}") from exc
        except BotoCoreError as exc:
            raise translate(exc, f"GET {self._url(path)}") from exc

    def open_range(self, info: ObjectInfo, start: int, end: int) -> ByteStream:
        extra = {"IfMatch": info.etag} if info.etag else {}
        # Translation happens in the transfer loop, after its retries.
        response = self._data_client.get_object(
            Bucket=self.bucket,
            Key=self.prefix + info.path,
            Range=f"bytes={start}-{end - 1}",
            **extra,
        )
        body: ByteStream = response["Body"]
        return body

    def sha256_checksum(self, info: ObjectInfo) -> str | None:
        try:
            head = self._client.head_object(
                Bucket=self.bucket, Key=self.prefix + info.path, ChecksumMode="ENABLED"
            )
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, f"HEAD {self._url(info.path)}") from exc
        value = head.get("ChecksumSHA256")
        # A multipart upload carries a checksum of part checksums ("...-N"), not of the file.
        if not value or "-" in str(value) or head.get("ChecksumType") == "COMPOSITE":
            return None
        return base64.b64decode(str(value)).hex()
