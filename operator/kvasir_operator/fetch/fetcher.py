"""One fetch, start to finish: catalog, reuse check, plan, transfer, verify, publish, mark.

Decide, then act: everything that can refuse the fetch (missing objects, no checksums, not enough
disk) runs before the first byte is written. Nothing appears under its final name until every
file of the model was verified; the marker is written last, so its presence means "complete".
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .catalog import read_catalog
from .errors import ChecksumMismatch, DiskFull, UsageError
from .manifest import Manifest, ManifestFile, sha256_file
from .marker import marker_matches, remove_marker, write_marker
from .objects import ObjectInfo
from .options import FetchOptions
from .partfile import PartFile
from .progress import Progress
from .source import open_source
from .transfer import Transfer

_VERIFY_WORKERS = 2
_SPACE_SLACK = 4 * 1024 * 1024  # sidecars, marker, filesystem metadata


@dataclasses.dataclass(frozen=True)
class FetchResult:
    manifest_digest: str
    files_fetched: int
    files_reused: int
    bytes_fetched: int  # bytes transferred by this run (resumed ranges excluded)
    is_noop: bool  # a matching marker was found; nothing was read from the source


def _hash_matches(path: Path, entry: ManifestFile) -> bool:
    return entry.sha256 is not None and sha256_file(path) == entry.sha256


def _verify_in_place(root: Path, manifest: Manifest, progress: Progress) -> None:
    progress.update(phase="Verifying")
    for entry in manifest.files:
        full = root / entry.path
        if entry.sha256 is not None and not _hash_matches(full, entry):
            raise ChecksumMismatch(f"{full}: SHA-256 differs from the manifest")
        progress.add_files(1)
        progress.update(bytes_done=progress.bytes_done + entry.size)


def _check_space(dest: Path, parts: list[PartFile]) -> None:
    needed = sum(part.bytes_to_allocate() for part in parts)
    stat = os.statvfs(dest)
    free = stat.f_bavail * stat.f_frsize
    if needed + _SPACE_SLACK > free:
        raise DiskFull(f"{dest}: needs {needed} bytes for the model but only {free} bytes are free")


def _verify_part(part: PartFile, entry: ManifestFile, progress: Progress) -> str | None:
    """None when the bytes are good; else the mismatch message (the .part is deleted)."""
    if not part.verified and entry.sha256 is not None:
        if not _hash_matches(part.part, entry):
            part.discard()
            return f"{entry.path}: SHA-256 of the downloaded bytes differs from the manifest"
        part.mark_verified()
    progress.add_files(1)
    return None


def _reuse_existing(dest: Path, entry: ManifestFile) -> bool:
    """A file already under its final name (an interrupted publish, an unchanged shard)."""
    full = dest / entry.path
    try:
        if full.stat().st_size != entry.size:
            return False
    except OSError:
        return False
    return _hash_matches(full, entry)


def fetch(uri: str, dest: Path, options: FetchOptions, progress: Progress) -> FetchResult:
    source = open_source(uri, options)
    catalog = read_catalog(source, allow_unverified=options.allow_unverified)
    manifest = catalog.manifest
    files_total = len(manifest.files)
    progress.update(
        manifest_digest=manifest.digest, bytes_total=manifest.total_bytes, files_total=files_total
    )
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"DEST {str(dest)!r} exists and is not a directory")
    if source.local_root is not None and dest.resolve() == source.local_root.resolve():
        _verify_in_place(dest, manifest, progress)
        if os.access(dest, os.W_OK):
            write_marker(dest, source.uri, manifest)
        return FetchResult(manifest.digest, 0, files_total, 0, is_noop=False)
    dest.mkdir(parents=True, exist_ok=True)
    if marker_matches(dest, source.uri, manifest):
        progress.update(
            bytes_done=manifest.total_bytes, files_done=files_total, files_reused=files_total
        )
        return FetchResult(manifest.digest, 0, files_total, 0, is_noop=True)

    remove_marker(dest)
    progress.update(phase="Verifying", message="checking files already on disk")
    reused = [e for e in manifest.files if _reuse_existing(dest, e)]
    reused_paths = {e.path for e in reused}
    todo: list[tuple[PartFile, ObjectInfo, ManifestFile]] = []
    for entry in manifest.files:
        if entry.path in reused_paths:
            continue
        info = catalog.objects[entry.path]
        identity = {
            "object": f"{source.uri}/{entry.path}",
            "size": entry.size,
            "sha256": entry.sha256,
            "etag": info.etag,
        }
        todo.append((PartFile(dest / entry.path, entry.size, identity), info, entry))
    parts = [part for part, _, _ in todo]
    _check_space(dest, parts)
    progress.update(
        phase="Downloading",
        message="",
        files_reused=len(reused),
        files_done=len(reused),
        bytes_done=sum(e.size for e in reused) + sum(p.bytes_done for p in parts),
    )

    entries = {id(part): entry for part, _, entry in todo}
    verify_pool = ThreadPoolExecutor(_VERIFY_WORKERS, thread_name_prefix="kvasir-verify")
    checks: list[Future[str | None]] = []
    try:
        for part in parts:
            part.open()
        Transfer(source, options, progress).run(
            [(part, info) for part, info, _ in todo],
            lambda part: checks.append(
                verify_pool.submit(_verify_part, part, entries[id(part)], progress)
            ),
        )
        progress.update(phase="Verifying")
        failures = [msg for msg in (check.result() for check in checks) if msg is not None]
    finally:
        verify_pool.shutdown(wait=True, cancel_futures=True)
        for part in parts:
            part.close()
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise ChecksumMismatch(failures[0] + more + "; the bad file was deleted, nothing published")

    for part in parts:
        part.publish()
    write_marker(dest, source.uri, manifest)
    return FetchResult(
        manifest.digest, len(parts), len(reused), progress.bytes_fetched, is_noop=False
    )
