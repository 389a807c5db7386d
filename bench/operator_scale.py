"""The operator at fleet scale (issue 35): N InferenceServices, requests per object per minute in
steady state, time to converge after a restart, the operator's memory.

No kube-apiserver binary can be installed on these machines, so the server is kmock (an
in-memory Kubernetes emulator over real HTTP on 127.0.0.1) with the API server's semantics the
tests give it (tests/kmock_server.py: selectors, create on apply, resourceVersions) and its
request log as the accounting. The operator is the real one, `kvasir-operator run --namespace
bench` in its own process, with its default resync interval (60 s).

For each N:
1. create N InferenceServices (half with the builtin autoscaler, half external; no pods, as
   before the scheduler places any), start the operator, wait until every one has its
   Deployment and a status (first convergence);
2. steady state: after a quiet spell, count the operator's requests over `--steady-seconds`
   (reads = GETs other than watch streams, writes = POST/PUT/PATCH/DELETE, watch streams opened
   apart), per object per minute;
3. restart: stop the operator (SIGTERM), start a new one, time until it has reconciled every
   object (its `kvasir_operator_reconciles_total` series, one per object) and count what it
   wrote meanwhile;
4. the operator's resident memory (VmRSS, and VmHWM its peak) at the end.

    python bench/operator_scale.py --sizes 10 100 1000 --out bench/results/operator_scale

Writes operator_scale.json and operator_scale.png (results.write_results).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from results import write_results

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "operator")]

from auth_proxy import kubeconfig  # noqa: E402  (the tests' support, on the path above)
from conftest import free_port  # noqa: E402
from kmock_namespaces import namespaces_served  # noqa: E402
from kmock_server import server_semantics  # noqa: E402
from operator_support import isvc, serve_operator_cluster  # noqa: E402

NS = "bench"
ISVCS = "kvasir.dev/v1alpha1/inferenceservices"
WRITES = ("POST", "PUT", "PATCH", "DELETE")
OPERATOR = str(ROOT / ".venv" / "bin" / "kvasir-operator")
RESYNC_SECONDS = 60.0  # the operator's default KVASIR_RECONCILE_INTERVAL_SECONDS


def spec(i: int) -> dict[str, Any]:
    mode = "builtin" if i % 2 else "external"
    return {"model": {"uri": f"/models/m{i}", "sizeBytes": 1_000_000_000},
            "resources": {"gpus": 1}, "autoscaling": {"mode": mode}}


class RequestLog:
    """Every request kmock served, kept here; kmock's own log is trimmed as it grows.

    kmock tells which reaction serves a request by scanning its whole request log, per request:
    quadratic in the number of requests, which made the emulator, not the operator, the
    bottleneck at 1,000 objects. Only the latest entries stay in kmock's log (a request still
    being matched is among them)."""

    KEEP = 50

    def __init__(self, kmock: Any) -> None:
        self.kmock, self.all, self._copied = kmock, [], 0
        self._task: asyncio.Task[None] | None = None

    def collect(self) -> list[Any]:
        log = self.kmock._requests  # kmock has no public way to forget requests
        self.all.extend(log[self._copied:])
        if len(log) > 2 * self.KEEP:
            del log[:len(log) - self.KEEP]
        self._copied = len(log)
        return self.all

    async def _run(self) -> None:
        while True:
            self.collect()
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def __len__(self) -> int:
        return len(self.collect())


def operator_requests(log: list[Any]) -> list[Any]:
    return [r for r in log if not str(r.headers.get("User-Agent", "")).startswith("kmock")]


def classify(requests: list[Any]) -> dict[str, int]:
    watches = sum(1 for r in requests if r.params.get("watch") == "true")
    scrapes = sum(1 for r in requests if "/proxy" in r.url.path)
    reads = sum(1 for r in requests if r.method == "GET" and r.params.get("watch") != "true"
                and "/proxy" not in r.url.path)
    writes = sum(1 for r in requests if r.method in WRITES)
    return {"reads": reads, "writes": writes, "watch_streams": watches, "scrapes": scrapes}


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def start_operator(config: Path, metrics_port: int, log_path: Path) -> subprocess.Popen[bytes]:
    log = log_path.open("ab")
    return subprocess.Popen(
        [OPERATOR, "run", "--namespace", NS, "--kubeconfig", str(config),
         "--metrics-port", str(metrics_port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_operator(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def reconciled_objects(port: int) -> int:
    """How many objects the operator process has reconciled at least once."""
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    except httpx.HTTPError:
        return 0
    names = {line.split('inferenceservice="', 1)[1].split('"', 1)[0] for line in text.splitlines()
             if line.startswith("kvasir_operator_reconciles_total{") and 'inferenceservice="' in line
             and not line.rstrip().endswith(" 0.0")}
    return len(names)


def converged(kmock: Any, n: int) -> bool:
    """Every object has its Deployment and a status phase (one pass over the store: the check
    runs in the emulator's own event loop, so it must not slow the server it watches)."""
    deployments, phased = set(), set()
    for key, obj in kmock.objects.items():
        if key[0] == "apps/v1/deployments" and not obj.deleted:
            deployments.add(key[2])
        elif key[0] == ISVCS and (obj.get("status") or {}).get("phase"):
            phased.add(key[2])
    return all(f"m{i}" in deployments and f"m{i}" in phased for i in range(n))


async def wait_for(what: str, check: Any, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if await check():
            return time.monotonic() - start
        await asyncio.sleep(1.0)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


async def one_size(n: int, steady_seconds: float, workdir: Path) -> dict[str, Any]:
    import kmock as km

    async with km.KubernetesEmulator() as kmock, km.Server(kmock) as server:
        serve_operator_cluster(kmock, (NS,))
        log = RequestLog(kmock)
        log.start()
        for i in range(n):
            kmock.objects[ISVCS, NS, f"m{i}"] = isvc(f"m{i}", NS, f"uid-{i}", spec(i))
        config = kubeconfig(workdir / f"kubeconfig-{n}", str(server.url).rstrip("/"), {})
        port = free_port()
        log_path = workdir / f"operator-{n}.log"
        proc = start_operator(config, port, log_path)
        try:
            first = await wait_for("first convergence", lambda: _async(converged(kmock, n)),
                                   timeout=60 + n * 2.0)
            # Settled: no write for a resync interval and more (the first resync adds what only
            # the autoscaler's first tick could tell, e.g. the MetricsAvailable condition).
            quiet = Quiet(log)
            await wait_for("a quiet spell", lambda: quiet.for_seconds(RESYNC_SECONDS + 5),
                           timeout=600)
            mark = len(log)
            await asyncio.sleep(steady_seconds)
            steady = classify(operator_requests(log.collect()[mark:]))
            stop_operator(proc)
            mark = len(log)
            port = free_port()
            restart_at = time.monotonic()
            proc = start_operator(config, port, log_path)
            await wait_for("restart convergence", lambda: _restart_check(port, n),
                           timeout=60 + n * 2.0)
            restart = time.monotonic() - restart_at  # from the process start
            restarted = operator_requests(log.collect()[mark:])
            after_restart = classify(restarted)
            restart_writes = sorted({f"{r.method} {r.url.path.replace(NS, 'NS')}"
                                     f"{' ' + str(r.data)[:300] if r.method in WRITES else ''}"
                                     for r in restarted if r.method in WRITES})[:6]
            memory = memory_kib(proc.pid)
        finally:
            stop_operator(proc)
    minutes = steady_seconds / 60
    return {
        "n": n, "first_convergence_s": round(first, 1), "restart_convergence_s": round(restart, 1),
        "steady_seconds": steady_seconds, "steady": steady,
        "reads_per_object_per_minute": round(steady["reads"] / n / minutes, 3),
        "writes_per_object_per_minute": round(steady["writes"] / n / minutes, 3),
        "restart_requests": after_restart, "restart_writes_sample": restart_writes,
        "rss_mib": round(memory.get("VmRSS", 0) / 1024, 1),
        "peak_rss_mib": round(memory.get("VmHWM", 0) / 1024, 1),
    }


class Quiet:
    """Whether the operator has written nothing for a while (polled)."""

    def __init__(self, log: RequestLog) -> None:
        self.log, self.count, self.since = log, -1, time.monotonic()

    async def for_seconds(self, seconds: float) -> bool:
        writes = sum(1 for r in operator_requests(self.log.collect()) if r.method in WRITES)
        if writes != self.count:
            self.count, self.since = writes, time.monotonic()
            return False
        return time.monotonic() - self.since >= seconds


async def _async(value: bool) -> bool:
    return value


async def _restart_check(port: int, n: int) -> bool:
    return await reconciled_objects(port) >= n


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sizes"]
    ns = [str(r["n"]) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.35
    xs = range(len(ns))
    axes[0].bar([x - width / 2 for x in xs], [r["reads_per_object_per_minute"] for r in rows],
                width, label="reads")
    axes[0].bar([x + width / 2 for x in xs], [r["writes_per_object_per_minute"] for r in rows],
                width, label="writes")
    axes[0].axhline(2, color="grey", linestyle="--", label="target: reads <= 2")
    axes[0].set(xticks=list(xs), xticklabels=ns, xlabel="InferenceServices",
                ylabel="requests / object / minute", title="steady state")
    axes[0].legend()
    axes[1].bar(ns, [r["restart_convergence_s"] for r in rows])
    axes[1].axhline(60, color="grey", linestyle="--", label="target: < 60 s")
    axes[1].set(xlabel="InferenceServices", ylabel="seconds", title="converged after restart")
    axes[1].legend()
    axes[2].bar(ns, [r["rss_mib"] for r in rows])
    axes[2].axhline(300, color="grey", linestyle="--", label="target: < 300 MiB")
    axes[2].set(xlabel="InferenceServices", ylabel="MiB", title="operator resident memory")
    axes[2].legend()
    fig.suptitle(f"kvasir-operator against kmock on 127.0.0.1 — {result['host_cpu']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--steady-seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/operator_scale")
    args = parser.parse_args()
    from results import host_line

    rows = []
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp, \
            server_semantics(mp), namespaces_served(mp):
        for n in args.sizes:
            row = asyncio.run(one_size(n, args.steady_seconds, Path(tmp)))
            print(row, flush=True)
            rows.append(row)
    write_results({"server": "kmock 0.8 with tests/kmock_server.py semantics, 127.0.0.1",
                   "host_cpu": host_line(), "pid": os.getpid(), "sizes": rows},
                  args.out, plot)


if __name__ == "__main__":
    main()
