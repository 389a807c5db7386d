"""A real SIGKILL half-way through a download, then a rerun that fetches only what was missing.

The kill evidence and the refetch evidence are independent: the sidecars written by the killed
process say which ranges were finished; the recording proxy (server side) says which ranges the
second process asked for. They must be exact complements.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from fetch_proxy import RecordingProxy
from fetch_support import assert_model, fetch_cmd, fetch_env, model_files
from kvasir_operator.fetch.partfile import merge_ranges, split_missing

PART = 65536


def _sidecar_ranges(dest: Path) -> dict[str, list[tuple[int, int]]]:
    done = {}
    for sidecar in dest.rglob("*.part.json"):
        rel = sidecar.relative_to(dest).as_posix()[: -len(".part.json")]
        done[rel] = [(int(s), int(e)) for s, e in json.loads(sidecar.read_text())["done"]]
    return done


def _wait_for_progress(dest: Path, proc: subprocess.Popen[str], min_ranges: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            shard = _sidecar_ranges(dest).get("model-00001-of-00002.safetensors", [])
            if sum(e - s for s, e in shard) >= min_ranges * PART:
                return
        except (OSError, ValueError):
            pass  # a sidecar caught mid-replace; look again
        time.sleep(0.02)
    raise AssertionError(f"no progress to kill at (rc={proc.poll()})")


def _requested(proxy: RecordingProxy) -> dict[str, list[tuple[int, int]]]:
    asked: dict[str, list[tuple[int, int]]] = {}
    for get in proxy.ranged_gets():
        start, last = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", get.range or "").groups())
        rel = get.key.split("/llama/", 1)[1]
        asked.setdefault(rel, []).append((start, last + 1))
    return asked


def test_sigkill_then_resume_fetches_only_missing_ranges(
    upload: Any, proxy: RecordingProxy, tmp_path: Path
) -> None:
    model = upload(model_files(seed=7))
    dest = tmp_path / "cache"
    proxy.range_delay_s = 0.03  # throttle so the kill lands half-way
    killed = subprocess.Popen(
        fetch_cmd(
            model.uri,
            dest,
            "--endpoint-url",
            proxy.url,
            "--part-size",
            str(PART),
            "--concurrency",
            "1",
        ),
        env=fetch_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_progress(dest, killed, min_ranges=6)
        killed.send_signal(signal.SIGKILL)
    finally:
        killed.wait(timeout=30)
        assert killed.stderr is not None
        killed.stderr.close()
    assert killed.returncode == -signal.SIGKILL
    assert not (dest / ".kvasir-complete.json").exists()

    done_before = _sidecar_ranges(dest)
    done_bytes = sum(e - s for ranges in done_before.values() for s, e in ranges)
    total = sum(len(d) for d in model.files.values())
    assert 6 * PART <= done_bytes < total

    proxy.reset()
    proxy.range_delay_s = 0.0
    rerun = subprocess.run(
        fetch_cmd(model.uri, dest, "--endpoint-url", proxy.url, "--part-size", str(PART)),
        env=fetch_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert_model(dest, model.files)

    asked = _requested(proxy)
    for rel, data in model.files.items():
        expected = split_missing(done_before.get(rel, []), len(data), PART)
        assert sorted(asked.get(rel, [])) == expected, rel
        # Together, finished-before and fetched-now cover the file exactly once.
        both = done_before.get(rel, []) + asked.get(rel, [])
        assert merge_ranges(both) == [(0, len(data))]
        assert sum(e - s for s, e in both) == len(data)
    assert sum(len(v) for v in asked.values()) < -(-total // PART)  # fewer GETs than a fresh run
