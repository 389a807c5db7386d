"""What every source lists and streams: `ObjectInfo`, `ByteStream`, and the `Source` protocol.

The transfer, verification and capacity code only ever sees these, so a new store is one class
(source.py: `LocalSource` and `open_source`; s3source.py: `S3Source`). Nothing here imports a
store.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    path: str  # relative POSIX path under the source root/prefix
    size: int  # bytes
    etag: str | None = None  # S3 ETag (quoted, as S3 returns it); None for local files
    sha256: str | None = None  # hex, from an S3 full-object SHA-256 checksum when one exists


class ByteStream(Protocol):
    def read(self, amt: int) -> bytes: ...

    def close(self) -> None: ...


class Source(Protocol):
    uri: str
    # The directory holding the files when they are already on a local filesystem (in-place
    # verification is then possible); None for remote stores.
    local_root: Path | None

    def list_objects(self) -> list[ObjectInfo]:
        """Every object under the root, manifest included, fetcher scratch files excluded."""
        ...

    def read_small(self, path: str, limit: int = 16 * 1024 * 1024) -> bytes | None:
        """The whole content of a small object (manifest, config.json); None if it is absent."""
        ...

    def open_range(self, info: ObjectInfo, start: int, end: int) -> ByteStream:
        """A stream of bytes [start, end) of the object; raises on a changed object."""
        ...

    def sha256_checksum(self, info: ObjectInfo) -> str | None:
        """The store's full-object SHA-256 (hex) for this object, when it keeps one."""
        ...
