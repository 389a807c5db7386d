"""The fetcher's configuration: one frozen, validated `FetchOptions`, built once by the CLI.

Defaults are sized for an initContainer pulling multi-GB safetensors from S3 to NVMe: 8 parallel
ranged GETs of 16 MiB keep a 10-25 Gb/s link busy without ballooning memory (each in-flight part
buffers at most one 1 MiB chunk), and a 60 s stall timeout is far above any healthy S3 latency.
"""

from __future__ import annotations

import dataclasses

MiB = 1024 * 1024
ADDRESSING_STYLES = ("auto", "path", "virtual")


@dataclasses.dataclass(frozen=True)
class FetchOptions:
    endpoint_url: str | None = (
        None  # S3-compatible endpoint; None: boto3's own (AWS_ENDPOINT_URL...)
    )
    region: str | None = None  # None: boto3's default chain (AWS_REGION, profile, us-east-1)
    addressing_style: str = "auto"
    concurrency: int = 8  # ranged GETs in flight, across all files
    part_size: int = 16 * MiB  # bytes per ranged GET; also the resume granularity
    stall_timeout: float = 60.0  # seconds without a byte on a connection before it counts as dead
    retries: int = 5  # extra attempts per request after the first, with exponential backoff
    allow_unverified: bool = False  # accept a source with neither manifest nor S3 SHA-256 checksums
    progress_interval: float = 5.0  # seconds between progress lines / pod annotation patches
    pvc_root: str = (
        "/mnt/kvasir-pvc"  # where pvc://claim/path is mounted: <pvc_root>/<claim>/<path>
    )

    def __post_init__(self) -> None:
        if self.addressing_style not in ADDRESSING_STYLES:
            raise ValueError(
                f"addressing_style must be one of {', '.join(ADDRESSING_STYLES)}, "
                f"got {self.addressing_style!r}"
            )
        if self.concurrency < 1 or self.concurrency > 256:
            raise ValueError(f"concurrency must be in 1..256, got {self.concurrency}")
        if self.part_size < 64 * 1024:
            raise ValueError(f"part_size must be at least 65536 bytes, got {self.part_size}")
        if not self.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {self.stall_timeout}")
        if self.retries < 0 or self.retries > 100:
            raise ValueError(f"retries must be in 0..100, got {self.retries}")
        if not self.progress_interval > 0:
            raise ValueError(f"progress_interval must be > 0 seconds, got {self.progress_interval}")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"endpoint_url must start with http:// or https://, got {self.endpoint_url!r}"
            )
