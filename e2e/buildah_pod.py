"""A pod's containers run as the kubelet would, with `buildah run --isolation chroot`.

The pieces of e2e/local_pod.py that know buildah: a container's user, capabilities, volumes and
env as `buildah run` arguments (`Pod`), its main process (the one a SIGTERM goes to), and the
check that stands in for a read-only root filesystem, which buildah cannot mount: after the
container has run, its image's writable layer must hold nothing outside its volumes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

START = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - START:7.1f}s] {message}", flush=True)


def fail(message: str) -> None:
    log(f"FAIL: {message}")
    raise SystemExit(1)


# buildah's default capability set. Its `--cap-drop ALL` also drops what `--cap-add` names
# (buildah 1.28), so "drop ALL, add X" is spelt as dropping every default one but X.
DEFAULT_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
                "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "SETFCAP")


def cap_drops(capabilities: dict[str, list[str]]) -> list[str]:
    if capabilities.get("drop") != ["ALL"]:
        fail(f"the pod keeps default capabilities: {capabilities}")
    kept = set(capabilities.get("add", []))
    return [arg for cap in DEFAULT_CAPS if cap not in kept for arg in ("--cap-drop", f"CAP_{cap}")]


def check_root_unwritten(name: str, ctr: str, mounts: set[str]) -> None:
    """readOnlyRootFilesystem, verified: nothing written in the image's own layer, outside the
    mount points buildah makes for the volumes."""
    merged = subprocess.run(["buildah", "mount", ctr], check=True, capture_output=True,
                            text=True).stdout.strip()
    upper = Path(merged).parent / "diff"
    parents = {str(p) for m in mounts for p in Path(m).parents}
    written = []
    for path in upper.rglob("*"):
        inside = "/" + str(path.relative_to(upper))
        if inside in mounts or (path.is_dir() and inside in parents):
            continue
        if inside == "/run" and path.is_dir() and not any(path.iterdir()):
            continue  # buildah run's own mount point for its runtime files
        if any(inside.startswith(m + "/") for m in mounts):
            continue
        written.append(inside)
    subprocess.run(["buildah", "umount", ctr], check=True, capture_output=True)
    if written:
        fail(f"{name} wrote outside its volumes: {sorted(written)[:10]}")
    log(f"{name}: root filesystem unwritten (readOnlyRootFilesystem holds)")


class Pod:
    """The pod's volumes as host directories, and its containers as buildah working containers."""

    def __init__(self, spec: dict[str, Any], name: str, work: Path) -> None:
        """`work`: where the pod's emptyDirs and logs go, one directory per pod."""
        self.spec, self.name = spec, name
        self.root = work / name
        self.volume_dirs: dict[str, Path] = {}
        for volume in spec["volumes"]:
            self.volume_dirs[volume["name"]] = self._volume(volume)
        self.containers: list[str] = []

    def _volume(self, volume: dict[str, Any]) -> Path:
        fs_group = self.spec["securityContext"]["fsGroup"]
        if "hostPath" in volume:  # DirectoryOrCreate: the kubelet makes it as root, 0755
            path = Path(volume["hostPath"]["path"])
            path.mkdir(mode=0o755, exist_ok=True)
            return Path(path)
        path = self.root / "volumes" / str(volume["name"])
        path.mkdir(parents=True)
        if "projected" in volume:  # the token: no API server here, so the fetch goes without
            for item in ("token", "ca.crt", "namespace"):
                (path / item).write_text("default" if item == "namespace" else "")
        # emptyDir: 0777 and, with fsGroup, group-owned by it
        os.chown(path, 0, fs_group)
        path.chmod(0o2777)
        return path

    def run_args(self, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        image = container["image"]
        ctr = subprocess.run(["buildah", "from", "--pull-never", "--name",
                              f"{self.name}-{container['name']}", image],
                             check=True, capture_output=True, text=True).stdout.strip()
        self.containers.append(ctr)
        pod_sc, sc = self.spec["securityContext"], container.get("securityContext", {})
        user = sc.get("runAsUser", pod_sc["runAsUser"])
        group = sc.get("runAsGroup", pod_sc["runAsGroup"])
        if user == 0 and sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            fail(f"{container['name']}: runs as root under runAsNonRoot")
        args = ["buildah", "run", "--isolation", "chroot", "--network", "host",
                "--user", f"{user}:{group}", *cap_drops(sc.get("capabilities", {}))]
        for mount in container.get("volumeMounts", []):
            mode = "ro" if mount.get("readOnly") else "rw"
            args += ["--volume", f"{self.volume_dirs[mount['name']]}:{mount['mountPath']}:{mode}"]
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            elif item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name":
                env[item["name"]] = self.name
            else:
                env[item["name"]] = "default"
        for key, value in sorted(env.items()):
            args += ["--env", f"{key}={value}"]
        return [*args, ctr, "--", *container["command"], *container.get("args", [])]

    def check_root_unwritten(self, container: dict[str, Any], ctr: str) -> None:
        if container.get("securityContext", {}).get("readOnlyRootFilesystem"):
            check_root_unwritten(container["name"], ctr,
                                 {m["mountPath"] for m in container.get("volumeMounts", [])})

    def remove(self) -> None:
        for ctr in self.containers:
            subprocess.run(["buildah", "rm", ctr], capture_output=True)


def main_process(runner: subprocess.Popen[bytes]) -> int:
    """The container's own main process (the kubelet's SIGTERM goes to it): the first process
    under `buildah run` that is not one of buildah's chroot helpers."""
    for child in psutil.Process(runner.pid).children(recursive=True):
        command = child.cmdline()
        if command and not Path(command[0]).name.startswith("buildah"):
            return int(child.pid)
    fail("no container process under buildah run")
    return -1


def answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


@dataclass(frozen=True)
class Running:
    """An image started by `run_image`: its buildah process, container and mount points."""

    name: str
    process: subprocess.Popen[bytes]
    ctr: str
    mounts: frozenset[str]


def run_image(work: Path, name: str, image: str, command: list[str], probe: str,
              env: dict[str, str] | None = None, volumes: tuple[str, ...] = ()) -> Running:
    """A Deployment's container as the chart renders it: uid 1000, no capabilities, /tmp an
    emptyDir, read-only root; up once `probe` answers 200."""
    ctr = subprocess.run(["buildah", "from", "--pull-never", "--name", name, image],
                         check=True, capture_output=True, text=True).stdout.strip()
    args = ["buildah", "run", "--isolation", "chroot", "--network", "host", "--user",
            "1000:1000", *cap_drops({"drop": ["ALL"]}), "--volume", f"{work / name}:/tmp:rw"]
    for volume in volumes:
        args += ["--volume", volume]
    for key, value in (env or {}).items():
        args += ["--env", f"{key}={value}"]
    (work / name).mkdir(mode=0o777)
    os.chmod(work / name, 0o777)
    process = subprocess.Popen([*args, ctr, "--", *command], start_new_session=True,
                               stdout=(work / f"{name}.log").open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not answers_200(probe):
        if process.poll() is not None or time.monotonic() > deadline:
            fail(f"{name} did not answer {probe}: see {work / name}.log")
        time.sleep(0.5)
    log(f"{image}: {probe} 200")
    return Running(name, process, ctr, frozenset({"/tmp", *(v.split(":")[1] for v in volumes)}))


def stop_image(running: Running) -> int:
    os.kill(main_process(running.process), signal.SIGTERM)
    try:
        code = running.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(running.process.pid, signal.SIGKILL)
        code = running.process.wait()
    check_root_unwritten(running.name, running.ctr, set(running.mounts))
    subprocess.run(["buildah", "rm", running.ctr], capture_output=True)
    return code
