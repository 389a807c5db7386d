"""A destination that cannot hold the model -> exit 6 before any data is downloaded.

A real filesystem: a 1 MiB tmpfs mounted for the test (needs root and mount rights, as in this
CI container; skipped with the reason otherwise). The model is ~2 MiB, so the free-space pre-flight
refuses it; no ranged GET reaches the server and nothing is left on the small disk.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fetch_proxy import RecordingProxy
from fetch_support import model_files, run_fetch


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_not_enough_space_exits_6_before_downloading(
    upload: Any, proxy: RecordingProxy, small_disk: Path
) -> None:
    model = upload(model_files())
    assert sum(len(d) for d in model.files.values()) > 1024 * 1024
    result = run_fetch(model.uri, small_disk / "cache", "--endpoint-url", proxy.url)
    assert result.returncode == 6, result.stderr
    assert "DiskFull" in result.stderr and "free" in result.stderr
    assert proxy.ranged_gets() == []
    assert [p for p in (small_disk / "cache").rglob("*") if p.is_file()] == []
