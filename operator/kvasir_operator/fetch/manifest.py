"""The model manifest: the list of files with their sizes and SHA-256, and its digest.

`kvasir-manifest.json` sits beside the weights ({"version": 1, "files": [{"path", "size",
"sha256"}]}). Its digest (sha256 over a canonical JSON rendering, so key order and whitespace in
the published file do not matter) names the exact model content: it keys the node-local cache
marker and is what the operator reports as `status.modelDigest`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST_NAME = "kvasir-manifest.json"
# Files the fetcher itself writes into DEST; never part of a model.
RESERVED_SUFFIXES = (".part", ".part.json")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 4 * 1024 * 1024


def check_relative_path(path: str) -> str:
    """Reject paths that could escape DEST (absolute, `..`, backslashes, empty segments)."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        raise ValueError(f"path must be a relative POSIX path, got {path!r}")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts) or posixpath.normpath(path) != path:
        raise ValueError(f"path must be normalised and stay inside the model, got {path!r}")
    return path


@dataclasses.dataclass(frozen=True)
class ManifestFile:
    path: str  # relative POSIX path inside the model directory
    size: int  # bytes
    sha256: str | None  # lowercase hex; None only for an unverified (--allow-unverified) source

    def __post_init__(self) -> None:
        check_relative_path(self.path)
        if self.size < 0:
            raise ValueError(f"files[].size must be >= 0 for {self.path!r}, got {self.size}")
        if self.sha256 is not None and not _HEX64.match(self.sha256):
            raise ValueError(f"files[].sha256 of {self.path!r} must be 64 lowercase hex digits")


@dataclasses.dataclass(frozen=True)
class Manifest:
    files: tuple[ManifestFile, ...]
    # Where the checksums came from: "manifest", "s3-checksums" or "unverified" (size/ETag only).
    origin: str = "manifest"
    # For unverified sources the ETags stand in for content in the digest, so a changed object
    # still invalidates the cache marker.
    etags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("files[].path must be unique")
        if self.origin not in ("manifest", "s3-checksums", "unverified"):
            raise ValueError(
                f"origin must be manifest|s3-checksums|unverified, got {self.origin!r}"
            )

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def is_verified(self) -> bool:
        return all(f.sha256 is not None for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }

    @property
    def digest(self) -> str:
        body: dict[str, Any] = self.to_json()
        if self.etags:
            body["etags"] = list(self.etags)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(canonical).hexdigest()


def parse_manifest(raw: bytes) -> Manifest:
    """Parse and validate manifest bytes; ValueError names the offending field."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{MANIFEST_NAME} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{MANIFEST_NAME} must be a JSON object")
    if doc.get("version") != 1:
        raise ValueError(f"{MANIFEST_NAME}: version must be 1, got {doc.get('version')!r}")
    entries = doc.get("files")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{MANIFEST_NAME}: files must be a non-empty list")
    files = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{MANIFEST_NAME}: files[{index}] must be an object")
        path, size, sha = entry.get("path"), entry.get("size"), entry.get("sha256")
        if not isinstance(path, str):
            raise ValueError(f"{MANIFEST_NAME}: files[{index}].path must be a string")
        if not isinstance(size, int) or isinstance(size, bool):
            raise ValueError(f"{MANIFEST_NAME}: files[{index}].size must be an integer")
        if not isinstance(sha, str):
            raise ValueError(f"{MANIFEST_NAME}: files[{index}].sha256 must be a string")
        files.append(ManifestFile(path=path, size=size, sha256=sha.lower()))
    return Manifest(files=tuple(sorted(files, key=lambda f: f.path)))


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_scratch(rel_path: str) -> bool:
    """The fetcher's own files in DEST: partial downloads, their sidecars, the marker."""
    name = rel_path.rsplit("/", 1)[-1]
    return name == ".kvasir-complete.json" or name.endswith(RESERVED_SUFFIXES)


def is_reserved(rel_path: str) -> bool:
    return is_scratch(rel_path) or rel_path.rsplit("/", 1)[-1] == MANIFEST_NAME


def _walk(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if not is_reserved(rel) and not Path(dirpath, name).is_symlink():
                yield rel


def build_manifest(root: str | os.PathLike[str]) -> Manifest:
    """Hash every regular file under `root` (the fetcher's own files excluded)."""
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"manifest DIR must be a directory, got {str(root)!r}")
    files = [
        ManifestFile(path=rel, size=(base / rel).stat().st_size, sha256=sha256_file(base / rel))
        for rel in _walk(base)
    ]
    if not files:
        raise ValueError(f"manifest DIR {str(root)!r} holds no files")
    return Manifest(files=tuple(files))


def write_manifest(root: str | os.PathLike[str]) -> tuple[Path, Manifest]:
    manifest = build_manifest(root)
    target = Path(root) / MANIFEST_NAME
    tmp = target.with_name(MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, target)
    return target, manifest
