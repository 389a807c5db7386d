"""A file being downloaded: `<name>.part` plus the sidecar `<name>.part.json` of finished ranges.

Ranges are written in place with pwrite, in any order, by many threads. A range is recorded in
the sidecar only after its bytes were written, so after a SIGKILL the sidecar never claims bytes
that are not in the page cache (a power loss can tear that promise, but the final SHA-256 catches
it and the file is fetched again). The sidecar also records what the bytes belong to (size,
checksum, ETag): a resumed run reuses ranges only of the very same object.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

from .errors import DiskFull

Range = tuple[int, int]  # [start, end) in bytes


def merge_ranges(ranges: list[Range]) -> list[Range]:
    merged: list[Range] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def split_missing(done: list[Range], size: int, part_size: int) -> list[Range]:
    """The complement of `done` in [0, size), cut into pieces of at most part_size bytes."""
    gaps: list[Range] = []
    cursor = 0
    for start, end in merge_ranges(done) + [(size, size)]:
        if start > cursor:
            gaps.append((cursor, min(start, size)))
        cursor = max(cursor, end)
    return [
        (s, min(s + part_size, end)) for start, end in gaps for s in range(start, end, part_size)
    ]


class PartFile:
    def __init__(self, final: Path, size: int, identity: dict[str, Any]) -> None:
        self.final = final
        self.size = size
        self.part = final.with_name(final.name + ".part")
        self.sidecar = final.with_name(final.name + ".part.json")
        self._identity = identity
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.done: list[Range] = []
        self.verified = False
        self._load()

    def _load(self) -> None:
        try:
            doc = json.loads(self.sidecar.read_text(encoding="utf-8"))
            usable = (
                isinstance(doc, dict)
                and doc.get("identity") == self._identity
                and self.part.stat().st_size == self.size
            )
        except (OSError, ValueError):
            usable = False
        if usable:
            self.done = merge_ranges([(int(s), int(e)) for s, e in doc.get("done", [])])
            self.verified = bool(doc.get("verified", False))
        else:
            self.done, self.verified = [], False

    @property
    def bytes_done(self) -> int:
        return sum(end - start for start, end in self.done)

    @property
    def is_complete(self) -> bool:
        return self.done == [(0, self.size)] or self.size == 0

    def bytes_to_allocate(self) -> int:
        """Disk space this file still needs (already-allocated .part blocks count as held)."""
        try:
            held = self.part.stat().st_blocks * 512 if self.done else 0
        except OSError:
            held = 0
        return max(0, self.size - held)

    def open(self) -> None:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if not self.done:
            self.part.unlink(missing_ok=True)
        self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if self.size and os.fstat(self._fd).st_size != self.size:
                os.ftruncate(self._fd, self.size)
            if self.size and not self.done:
                # Reserve the blocks now so a full disk fails here, not 40 GB into the download.
                os.posix_fallocate(self._fd, 0, self.size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"no space left for {self.final.name} ({self.size} bytes)") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        self._save()

    def write(self, offset: int, data: bytes) -> None:
        if self._fd is None:
            raise RuntimeError(f"{self.part}: write() before open()")
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def mark_done(self, start: int, end: int) -> None:
        with self._lock:
            self.done = merge_ranges(self.done + [(start, end)])
            self._save()

    def mark_verified(self) -> None:
        with self._lock:
            self.verified = True
            self._save()

    def _save(self) -> None:
        doc = {"identity": self._identity, "done": self.done, "verified": self.verified}
        tmp = self.sidecar.with_name(self.sidecar.name + ".tmp")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, self.sidecar)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def publish(self) -> None:
        """Atomically move the verified bytes to their final name, then drop the sidecar."""
        self.close()
        if self.size == 0 and not self.part.exists():
            self.part.touch()
        with open(self.part, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(self.part, self.final)
        self.sidecar.unlink(missing_ok=True)

    def discard(self) -> None:
        self.close()
        self.part.unlink(missing_ok=True)
        self.sidecar.unlink(missing_ok=True)
