"""The completion marker `DEST/.kvasir-complete.json`: proof that DEST holds a verified model.

It is keyed by (source uri, manifest digest) and written last, after every file was hashed and
renamed into place. A later run trusts it only if each file still has its size and mtime and the
SHA-256 of its first and last 64 KiB is unchanged: a cheap re-check (milliseconds for a 100 GB
model) that catches truncation and overwrites without re-reading the whole cache on every start.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .manifest import Manifest

MARKER_NAME = ".kvasir-complete.json"
_SAMPLE = 64 * 1024


def sample_digest(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        digest.update(handle.read(_SAMPLE))
        if size > _SAMPLE:
            handle.seek(max(_SAMPLE, size - _SAMPLE))
            digest.update(handle.read(_SAMPLE))
    return digest.hexdigest()


def _file_record(dest: Path, rel: str, sha256: str | None) -> dict[str, Any]:
    full = dest / rel
    stat = full.stat()
    return {
        "path": rel,
        "size": stat.st_size,
        "sha256": sha256,
        "mtimeNs": stat.st_mtime_ns,
        "sampleSha256": sample_digest(full, stat.st_size),
    }


def write_marker(dest: Path, uri: str, manifest: Manifest) -> None:
    doc = {
        "uri": uri,
        "manifestDigest": manifest.digest,
        "origin": manifest.origin,
        "files": [_file_record(dest, f.path, f.sha256) for f in manifest.files],
        "completedAt": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    tmp = dest / (MARKER_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, dest / MARKER_NAME)
    _fsync_dir(dest)


def remove_marker(dest: Path) -> None:
    (dest / MARKER_NAME).unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def marker_matches(dest: Path, uri: str, manifest: Manifest) -> bool:
    """True when DEST holds this exact model, fetched from this uri, with its files intact."""
    try:
        doc = json.loads((dest / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict) or doc.get("uri") != uri:
        return False
    if doc.get("manifestDigest") != manifest.digest:
        return False
    records = {r.get("path"): r for r in doc.get("files", []) if isinstance(r, dict)}
    for entry in manifest.files:
        record = records.get(entry.path)
        try:
            if record is None or _file_record(dest, entry.path, entry.sha256) != record:
                return False
        except OSError:
            return False
    return True
