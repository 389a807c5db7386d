"""Readiness under load: how long `/ready` takes while the engine is saturated.

Kubernetes' readiness probe has a 1 s timeout by default; a probe that waits for an engine step to
finish flaps under load (a long prefill step holds it). This starts one server (or measures a
running one), keeps C closed-loop streaming clients busy (serving.py's workload), and meanwhile
probes `GET /ready` every `--interval` seconds with a kubelet-like timeout, recording each probe's
latency and status. Writes JSON + PNG (latency over time and its distribution).

    python bench/ready_latency.py --concurrency 16 --seconds 60 \
        --server ".venv/bin/kvasir-engine serve --host 127.0.0.1 --port 8101" --port 8101
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shlex
import sys
import time
from pathlib import Path

import httpx
from results import host_line, write_results
from serving import make_prompts, one_request, pct, start, stop, wait_ready


async def measure(url: str, concurrency: int, seconds: float, interval: float,
                  probe_timeout: float, max_tokens: int, seed: int) -> dict:
    prompts = make_prompts(seed, 100_000, 40, 160)
    deadline = time.monotonic() + seconds
    probes: list[dict[str, float]] = []
    num_requests = 0
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def user(i: int) -> None:
            nonlocal num_requests
            k = i
            while time.monotonic() < deadline:
                await one_request(client, url, None, prompts[k % len(prompts)], max_tokens)
                num_requests += 1
                k += concurrency

        async def prober() -> None:
            await asyncio.sleep(min(5.0, seconds / 4))  # let the load build up first
            async with httpx.AsyncClient(timeout=probe_timeout) as probe_client:
                t0 = time.monotonic()
                while time.monotonic() < deadline:
                    began = time.perf_counter()
                    try:
                        status = (await probe_client.get(f"{url}/ready")).status_code
                    except httpx.TimeoutException:
                        status = 0  # what kubelet counts as a failed probe
                    probes.append({"t": time.monotonic() - t0, "status": status,
                                   "seconds": time.perf_counter() - began})
                    await asyncio.sleep(interval)

        await asyncio.gather(prober(), *(user(i) for i in range(concurrency)))
    latencies = [p["seconds"] for p in probes]
    return {"concurrency": concurrency, "num_probes": len(probes),
            "num_requests_served": num_requests,
            "num_not_200": sum(1 for p in probes if p["status"] != 200),
            "ready_p50_seconds": pct(latencies, 50), "ready_p99_seconds": pct(latencies, 99),
            "ready_max_seconds": max(latencies, default=float("nan")), "probes": probes}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = result["probes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([p["t"] for p in probes], [p["seconds"] * 1000 for p in probes], ".", ms=3)
    ax1.set(xlabel="seconds into the load", ylabel="/ready latency (ms)", yscale="log",
            title=f"/ready under C={result['concurrency']} streaming clients")
    ax2.hist([p["seconds"] * 1000 for p in probes], bins=40)
    ax2.axvline(100, color="red", ls="--", label="100 ms")
    ax2.set(xlabel="/ready latency (ms)", ylabel="probes",
            title=f"p50 {result['ready_p50_seconds'] * 1000:.1f} ms, "
                  f"p99 {result['ready_p99_seconds'] * 1000:.1f} ms")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (instead of --server)")
    p.add_argument("--server", help="command that starts the server")
    p.add_argument("--port", type=int, default=8101, help="port of --server")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=0.2, help="seconds between probes")
    p.add_argument("--probe-timeout", type=float, default=1.0, help="kubelet's default: 1 s")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/ready_latency"))
    a = p.parse_args(argv)
    if bool(a.url) == bool(a.server):
        raise SystemExit("give exactly one of --url and --server")
    url = a.url or f"http://127.0.0.1:{a.port}"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    proc = start(a.server, a.out.with_suffix(".log")) if a.server else None
    try:
        wait_ready(url, proc)
        result = asyncio.run(measure(url, a.concurrency, a.seconds, a.interval,
                                     a.probe_timeout, a.max_tokens, a.seed))
    finally:
        if proc is not None:
            stop(proc)
    result = {"command": " ".join(shlex.quote(x) for x in sys.argv), "host": platform.node(),
              "cpu": host_line(), **result}
    print(f"C={a.concurrency}: {result['num_probes']} probes, p50 "
          f"{result['ready_p50_seconds'] * 1000:.1f} ms, p99 "
          f"{result['ready_p99_seconds'] * 1000:.1f} ms, max "
          f"{result['ready_max_seconds'] * 1000:.1f} ms, not 200: {result['num_not_200']}, "
          f"requests served {result['num_requests_served']}")
    write_results(result, a.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
