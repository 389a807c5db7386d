"""Where a model comes from: the source a URI names, and the local one.

`open_source(uri, options)` returns an S3 source (s3source.py) for `s3://bucket/prefix` and a
local source for `pvc://claim/path` (the operator mounts the claim at `<pvc_root>/<claim>`) or a
plain path; the URI is read by uri.py, the operator's parser too. The transfer, verification and
capacity code only ever sees the `Source` protocol (objects.py), so a new store is one class.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .errors import NotFound, UsageError
from .manifest import check_relative_path, is_scratch
from .objects import ByteStream, ObjectInfo, Source
from .options import FetchOptions
from .uri import PVC, S3, ModelUriError, parse_model_uri


class LocalSource:
    """A directory on a mounted filesystem (a PVC, a path baked into the image)."""

    def __init__(self, uri: str, root: Path) -> None:
        self.uri = uri
        self.local_root: Path | None = root
        self._root = root

    def list_objects(self) -> list[ObjectInfo]:
        if not self._root.is_dir():
            raise NotFound(f"source directory {str(self._root)!r} does not exist")
        found = []
        for dirpath, dirnames, filenames in os.walk(self._root):
            dirnames.sort()
            for name in sorted(filenames):
                full = Path(dirpath, name)
                rel = full.relative_to(self._root).as_posix()
                if full.is_file() and not is_scratch(rel):
                    found.append(ObjectInfo(path=rel, size=full.stat().st_size))
        return found

    def read_small(self, path: str, limit: int = 16 * 1024 * 1024) -> bytes | None:
        full = self._root / check_relative_path(path)
        if not full.is_file():
            return None
        if full.stat().st_size > limit:
            raise UsageError(f"{path} is larger than {limit} bytes")
        return full.read_bytes()

    def open_range(self, info: ObjectInfo, start: int, end: int) -> ByteStream:
        full = self._root / check_relative_path(info.path)
        try:
            handle = open(full, "rb")  # noqa: SIM115 - the caller owns and closes the stream
        except FileNotFoundError as exc:
            raise NotFound(f"{self.uri}/{info.path} disappeared") from exc
        handle.seek(start)
        return _BoundedFile(handle, end - start)

    def sha256_checksum(self, info: ObjectInfo) -> str | None:
        return None


class _BoundedFile:
    def __init__(self, handle: ByteStream, remaining: int) -> None:
        self._handle = handle
        self._remaining = remaining

    def read(self, amt: int) -> bytes:
        data = self._handle.read(min(amt, self._remaining)) if self._remaining > 0 else b""
        self._remaining -= len(data)
        return data

    def close(self) -> None:
        self._handle.close()


def open_source(uri: str, options: FetchOptions | None = None,
                credentials: Mapping[str, str] | None = None) -> Source:
    """The source for `s3://bucket/prefix`, `pvc://claim/path` or a local directory path.

    `credentials` (boto3 session keywords: aws_access_key_id, aws_secret_access_key,
    aws_session_token) replace boto3's default chain for S3; the fetcher itself never passes
    them (a pod gets its keys as AWS_* env), the operator does when it reads a Secret.
    """
    opts = options or FetchOptions()
    try:
        parsed = parse_model_uri(uri)
    except ModelUriError as exc:
        shape = f" ({exc.form})" if exc.form else ""
        raise UsageError(f"SOURCE {uri!r}: {exc.reason}{shape}") from None
    if parsed.kind == S3:
        from .s3source import S3Source  # boto3 is only imported when S3 is used

        return S3Source(parsed, opts, credentials)
    if parsed.kind == PVC:
        return LocalSource(uri, Path(opts.pvc_root, parsed.authority, parsed.path))
    return LocalSource(uri, Path(uri).resolve())
