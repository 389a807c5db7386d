"""What a source holds and how each file will be proven: the manifest, or the store's checksums.

This is also the small API the operator uses before it schedules a pod (capacity checks):

    source = open_source("s3://bucket/llama", FetchOptions(endpoint_url=...))
    catalog = read_catalog(source)          # raises the same FetchErrors as the CLI
    catalog.manifest.total_bytes, catalog.manifest.digest, source.read_small("config.json")
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

from .errors import ChecksumMismatch, NotFound, Unverified, UsageError
from .manifest import MANIFEST_NAME, Manifest, ManifestFile, parse_manifest
from .objects import ObjectInfo, Source

_HEAD_CONCURRENCY = 8


@dataclasses.dataclass(frozen=True)
class Catalog:
    manifest: Manifest
    objects: dict[str, ObjectInfo]  # manifest path -> the object to download


def _from_manifest(source: Source, raw: bytes, by_path: dict[str, ObjectInfo]) -> Catalog:
    try:
        manifest = parse_manifest(raw)
    except ValueError as exc:
        raise UsageError(f"{source.uri}/{MANIFEST_NAME}: {exc}") from exc
    objects = {}
    for entry in manifest.files:
        info = by_path.get(entry.path)
        if info is None:
            raise NotFound(f"{source.uri}/{entry.path} is listed in the manifest but missing")
        if info.size != entry.size:
            raise ChecksumMismatch(
                f"{source.uri}/{entry.path}: size {info.size} differs from the manifest's "
                f"{entry.size}"
            )
        objects[entry.path] = info
    return Catalog(manifest=manifest, objects=objects)


def _from_checksums(
    source: Source, by_path: dict[str, ObjectInfo], allow_unverified: bool
) -> Catalog:
    infos = [info for path, info in sorted(by_path.items()) if path != MANIFEST_NAME]
    with ThreadPoolExecutor(max_workers=_HEAD_CONCURRENCY) as pool:
        checksums = list(pool.map(source.sha256_checksum, infos))
    missing = [info.path for info, sha in zip(infos, checksums, strict=True) if sha is None]
    if missing and not allow_unverified:
        raise Unverified(
            f"{source.uri}: no {MANIFEST_NAME} and no S3 SHA-256 checksum for {len(missing)} "
            f"file(s) (e.g. {missing[0]}); publish a manifest with `kvasir-fetch manifest DIR` "
            "or pass --allow-unverified"
        )
    files = tuple(
        ManifestFile(path=info.path, size=info.size, sha256=sha)
        for info, sha in zip(infos, checksums, strict=True)
    )
    manifest = Manifest(
        files=files,
        origin="unverified" if missing else "s3-checksums",
        etags=tuple(info.etag or "" for info in infos) if missing else (),
    )
    return Catalog(manifest=manifest, objects={info.path: info for info in infos})


def read_catalog(source: Source, *, allow_unverified: bool = False) -> Catalog:
    """List the source and decide how each file is verified (manifest > S3 SHA-256 > refuse)."""
    by_path = {info.path: info for info in source.list_objects()}
    raw = source.read_small(MANIFEST_NAME) if MANIFEST_NAME in by_path else None
    if raw is not None:
        return _from_manifest(source, raw, by_path)
    if not any(path != MANIFEST_NAME for path in by_path):
        raise NotFound(f"{source.uri}: no model files")
    return _from_checksums(source, by_path, allow_unverified)


def read_manifest(source: Source, *, allow_unverified: bool = False) -> Manifest:
    return read_catalog(source, allow_unverified=allow_unverified).manifest
