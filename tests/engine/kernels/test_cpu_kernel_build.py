"""The native CPU extension's build survives a builder that died mid-build: torch's own lock
file (its "baton") is left behind by a killed process, and a start that waited on it would
hang forever (kernels/cpu.py takes an flock, released when its holder dies, and clears it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvasir_engine.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="native CPU kernels not buildable on this host")

LOAD = "from kvasir_engine.kernels import cpu; import sys; sys.exit(0 if cpu.available() else 3)"


def test_a_stale_torch_build_lock_does_not_hang_the_next_start(tmp_path: Path) -> None:
    source = cpu.build_dir()  # this tree's build, made by available() above
    assert (source / "kvasir_cpu.so").exists()
    cache = tmp_path / "kernels"
    shutil.copytree(source, cache / source.name)  # already built: the start only loads it
    (cache / source.name / "lock").write_text("")  # what a killed builder leaves
    env = {**os.environ, "KVASIR_KERNEL_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (cache / source.name / "lock").exists()
