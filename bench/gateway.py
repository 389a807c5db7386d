"""Gateway benchmarks, every process on 127.0.0.1; one JSON and one PNG.

1. Routing: N real engine replicas of the default model, each with `--engine-threads` OMP threads
   (prefix caching on, a KV cache that holds a replica's share of the tenants' system prompts but
   not all of them: 128 MiB, ~7 of the 12 ~780-token prompts), a multi-tenant workload (each
   tenant its own system prompt, mixed question and answer lengths, closed loop), sent through
   the gateway with `--routing round_robin`, `least_load`, `prefix` (ours, approximate) and
   `precise` (ours, from what the engines report holding) in one run, `--rounds` times with the
   order rotated (each round its own requests, the same for every policy; each policy its own
   system prompts, so no policy inherits another's cache), samples pooled. Reported: TTFT p50,
   output tokens/s, the engines' prefix-cache hit rate against an oracle's (every request after
   a tenant's first hits all the full blocks of its system prompt), and the busiest replica's
   in-flight requests over the mean (time-averaged, sampled from the gateway at 20 Hz while the
   stated concurrency is held, i.e. requests still wait to be sent; over the whole round too,
   the drain at its end included, where a few last requests split unevenly whatever the policy).
2. Quotas: two gateways sharing one real redis-server; tenant A saturates its tokens-per-minute
   with several clients, tenant B sends well below its own. A's admitted tokens (the engine's
   usage) over the last 60 s of the run, over the first minute and the most over any 60 s span
   (1 s steps) are compared with its quota. B must see no 429.
3. Overhead: a fake engine streaming at once; TTFT p50 direct vs through the gateway (both
   separate processes), then 1,000 concurrent streams through the gateway.

    flock /tmp/kvasir-cpu.lock .venv/bin/python bench/gateway.py --out bench/results/gateway
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from results import host_line, write_results
from serving import Sample, one_request, pct

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gateway"))
from gateway_support import FakeEngine, RedisServer, Served, free_port  # noqa: E402
from kvasir_gateway.app import create_app  # noqa: E402
from kvasir_gateway.config import GatewayConfig, QuotaLimits  # noqa: E402

PY = sys.executable
GATEWAY_KEY = "bench-gateway-key"
TOPICS = "ledger invoices payroll audit compliance shipping returns warranty onboarding security " \
         "outages billing refunds pricing contracts travel expenses hiring benefits training".split()


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} never became ready")


def system_prompt(rng: random.Random, tenant: str) -> str:
    words = " ".join(rng.choice(TOPICS) for _ in range(650))
    return f"You are the assistant of team {tenant}. Follow the team's handbook: {words}.\n"


def engine_counters(urls: list[str]) -> dict[str, float]:
    """The prefix-cache and preemption counters summed over the engines."""
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:num_preemptions_total")
    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


async def run_policy(gw: Served, engine_urls: list[str], model: str, policy_seed: int,
                     work_seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One round of one policy: its raw figures (summarize_policy pools the rounds)."""
    # Every policy gets the same requests (tenants in the same order, the same questions and
    # lengths, from work_seed) behind system prompts of its own (from policy_seed), so no policy
    # inherits another's cache and the policies differ in routing alone.
    tenants = [f"t{i}" for i in range(args.tenants)]
    system_rng = random.Random(policy_seed)
    systems = {t: system_prompt(system_rng, t) for t in tenants}
    rng = random.Random(work_seed)
    work = [(t, systems[t] + "Question: " + " ".join(rng.choice(TOPICS) for _ in range(
        rng.randint(5, 120))) + "?", rng.choice([8, 16, 32])) for t in
        (rng.choice(tenants) for _ in range(args.requests))]
    block = 16
    async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {GATEWAY_KEY}"}
                                 ) as c:
        sys_tokens = {t: len((await c.post(engine_urls[0] + "/tokenize", json={
            "model": model, "prompt": s})).json()["tokens"]) for t, s in systems.items()}
    seen: set[str] = set()
    oracle_hits = 0
    for tenant, _, _ in work:
        if tenant in seen:
            oracle_hits += sys_tokens[tenant] // block * block
        seen.add(tenant)
    before = engine_counters(engine_urls)
    gateway = gw.app.state.gateway
    # (busiest, mean, held): held while requests still wait to be sent, i.e. every client
    # busy and the stated concurrency in flight (not the drain at the end of the round).
    loads: list[tuple[int, float, bool]] = []
    stop = threading.Event()
    queue = list(reversed(work))

    def sample_loads() -> None:
        while not stop.is_set():
            in_flight = [r.num_in_flight for r in gateway.replicas.replicas.values()]
            if sum(in_flight):
                loads.append((max(in_flight), statistics.fmean(in_flight), bool(queue)))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample_loads, daemon=True)
    sampler.start()
    samples: list[Sample] = []
    clients = {t: httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers={
        "authorization": f"Bearer sk-{t}"}) for t in tenants}

    async def worker() -> None:
        while queue:
            tenant, prompt, max_tokens = queue.pop()
            samples.append(await one_request(clients[tenant], gw.url, model, prompt, max_tokens))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    for client in clients.values():
        await client.aclose()
    after = engine_counters(engine_urls)
    hits, queries, preemptions = (after[n] - before[n] for n in after)
    good = [s for s in samples if s.ok]
    decisions = {sample.labels.get("reason", ""): sample.value
                 for family in gateway.metrics.registry.collect()
                 if family.name in ("kvasir_gateway_routing_decisions",
                                    "kvasir_gateway_precise_fallbacks")
                 for sample in family.samples if sample.name.endswith("_total")}
    return {"ttfts": [s.ttft for s in good], "output_tokens": sum(s.num_output_tokens for s in good),
            "wall_seconds": wall, "requests": len(samples), "errors": len(samples) - len(good),
            "error_kinds": sorted({s.error for s in samples if not s.ok}),
            "preemptions": preemptions, "hits": hits, "queries": queries,
            "oracle_hits": oracle_hits, "decisions": decisions, "loads": loads}


def summarize_policy(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A policy's rounds pooled: TTFT percentiles over every request, hits over every query,
    throughput over the summed wall time, the load ratio over every 20 Hz sample."""
    ttfts = [t for r in runs for t in r["ttfts"]]
    hits, queries = sum(r["hits"] for r in runs), max(1.0, sum(r["queries"] for r in runs))
    hit_rate, oracle_rate = hits / queries, sum(r["oracle_hits"] for r in runs) / queries
    loads = [x for r in runs for x in r["loads"]]
    decisions: dict[str, float] = {}
    for r in runs:  # the gateway's counters start at zero each round
        for reason, count in r["decisions"].items():
            decisions[reason] = decisions.get(reason, 0.0) + count
    return {"rounds": len(runs), "requests": sum(r["requests"] for r in runs),
            "errors": sum(r["errors"] for r in runs),
            "error_kinds": sorted({k for r in runs for k in r["error_kinds"]}),
            "preemptions": sum(r["preemptions"] for r in runs),
            "wall_seconds": sum(r["wall_seconds"] for r in runs),
            "ttft_p50": pct(ttfts, 50), "ttft_p95": pct(ttfts, 95),
            "ttft_p50_by_round": [pct(r["ttfts"], 50) for r in runs],
            "output_tokens_per_s": sum(r["output_tokens"] for r in runs)
            / sum(r["wall_seconds"] for r in runs),
            "prefix_hit_rate": hit_rate, "oracle_hit_rate": oracle_rate,
            "hit_rate_vs_oracle": hit_rate / oracle_rate if oracle_rate else float("nan"),
            "hit_rate_vs_oracle_by_round": [
                r["hits"] / r["oracle_hits"] if r["oracle_hits"] else float("nan") for r in runs],
            "decisions": decisions,
            "busiest_over_mean_in_flight": busiest_over_mean([x for x in loads if x[2]]),
            "busiest_over_mean_in_flight_whole_round": busiest_over_mean(loads)}


def busiest_over_mean(loads: list[tuple[int, float, bool]]) -> float:
    """The busiest replica's in-flight requests over the mean, time-averaged over samples."""
    if not loads:
        return float("nan")
    return statistics.fmean(m for m, _, _ in loads) / statistics.fmean(a for _, a, _ in loads)


def bench_routing(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    (tmp / "gw.key").write_text(GATEWAY_KEY + "\n")
    keys = tmp / "tenants"
    keys.write_text("".join(f"t{i}:sk-t{i}\n" for i in range(args.tenants)))
    ports = [free_port() for _ in range(args.replicas)]
    procs = [subprocess.Popen(
        [str(Path(sys.executable).parent / "kvasir-engine"), "serve", "--host", "127.0.0.1", "--port", str(p),
         "--enable-prefix-caching", "--kv-cache-memory", args.kv_cache_memory, "--block-size",
         "16", "--max-model-len", "2048", "--trusted-gateway-key-file", str(tmp / "gw.key")],
        stdout=subprocess.DEVNULL, stderr=(tmp / f"engine-{p}.log").open("wb"),
        env={**os.environ, "OMP_NUM_THREADS": str(args.engine_threads)}) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    results: dict[str, Any] = {"replicas": args.replicas, "tenants": args.tenants,
                               "concurrency": args.concurrency, "load_bound": args.load_bound,
                               "prefix_miss_weight": args.prefix_miss_weight,
                               "load_tokens_per_request": args.load_tokens_per_request,
                               "kv_cache_memory": args.kv_cache_memory, "policies": {}}
    try:
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        policies = args.policies.split(",")
        runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
        for round_index in range(args.rounds):
            # Each round its own requests, every policy its own system prompts, and the order
            # rotated, so no policy always runs first on cold engines or last on warm ones.
            shift = round_index % len(policies)
            for policy in policies[shift:] + policies[:shift]:
                config = GatewayConfig(host="127.0.0.1", port=0, backends=tuple(urls),
                                       api_key_file=str(keys), upstream_key=GATEWAY_KEY,
                                       routing=policy, probe_interval_seconds=0.5,
                                       load_bound=args.load_bound,
                                       prefix_miss_weight=args.prefix_miss_weight,
                                       load_tokens_per_request=args.load_tokens_per_request)
                with Served(create_app(config)) as gw:
                    wait_ready(gw.url, None)
                    model = httpx.get(gw.url + "/v1/models", timeout=10, headers={
                        "authorization": "Bearer sk-t0"}).json()["data"][0]["id"]
                    policy_seed = 1000 + round_index * len(policies) + policies.index(policy)
                    run = asyncio.run(run_policy(gw, urls, model, policy_seed,
                                                 args.seed + round_index, args))
                runs[policy].append(run)
                one = summarize_policy([run])
                print(f"round {round_index} {policy}", json.dumps(
                    {k: v for k, v in one.items() if not k.endswith("_by_round")}), flush=True)
        results["rounds"] = args.rounds
        results["policies"] = {policy: summarize_policy(r) for policy, r in runs.items()}
        for policy, summary in results["policies"].items():
            print(policy, json.dumps(summary), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    rr = results["policies"].get("round_robin")
    for name, ours in results["policies"].items():
        if rr is not None and name != "round_robin":
            ours["ttft_p50_vs_round_robin"] = ours["ttft_p50"] / rr["ttft_p50"]
            ours["throughput_vs_round_robin"] = (ours["output_tokens_per_s"]
                                                 / rr["output_tokens_per_s"])
    return results


async def quota_clients(urls: list[str], seconds: float, log: list[tuple[float, str, int, int]],
                        num_a_clients: int) -> None:
    rng = random.Random(7)
    started = time.monotonic()

    async def client(tenant: str, url: str, pause: float) -> None:
        async with httpx.AsyncClient(timeout=30, headers={
                "authorization": f"Bearer sk-{tenant}"}) as c:
            while time.monotonic() - started < seconds:
                words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(20, 200)))
                resp = await c.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": words, "max_tokens": rng.choice([50, 100, 200])})
                used = resp.json().get("usage", {}).get("total_tokens", 0) if \
                    resp.status_code == 200 else 0
                log.append((time.monotonic() - started, tenant, resp.status_code, used))
                await asyncio.sleep(pause if resp.status_code == 200 else 0.1)

    await asyncio.gather(*(client("a", urls[i % 2], 0.0) for i in range(num_a_clients)),
                         client("b", urls[1], 1.0))


def bench_quota(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    redis = RedisServer(tmp)
    keys = tmp / "quota-keys"
    keys.write_text("a:sk-a\nb:sk-b\n")
    fake = FakeEngine(model="tiny", num_chunks=1, is_usage_from_body=True)
    limits = {"a": QuotaLimits(tokens_per_minute=args.quota_tpm),
              "b": QuotaLimits(tokens_per_minute=args.quota_tpm)}
    log: list[tuple[float, str, int, int]] = []
    try:
        with Served(fake.app()) as engine:
            config = GatewayConfig(host="127.0.0.1", port=0, backends=(engine.url,),
                                   api_key_file=str(keys), redis_url=redis.url,
                                   tenant_limits=limits, default_max_tokens=200)
            with Served(create_app(config)) as g1, Served(create_app(config)) as g2:
                wait_ready(g1.url, None)
                wait_ready(g2.url, None)
                asyncio.run(quota_clients([g1.url, g2.url], args.quota_seconds, log, 4))
    finally:
        redis.stop()

    def admitted(tenant: str, start: float, end: float) -> int:
        return sum(u for t, who, _, u in log if who == tenant and start <= t < end)

    warm = args.quota_seconds - 60
    steady = admitted("a", warm, warm + 60)
    return {"quota_tpm": args.quota_tpm, "window_seconds": [warm, warm + 60],
            "a_admitted_tokens_steady_minute": steady,
            "a_steady_error_vs_quota": steady / args.quota_tpm - 1,
            "a_admitted_tokens_first_minute": admitted("a", 0, 60),
            "a_max_tokens_any_minute": max(admitted("a", start, start + 60) for start in
                                           range(0, int(args.quota_seconds) - 59)),
            "a_requests": sum(1 for _, w, _, _ in log if w == "a"),
            "a_refused_429": sum(1 for _, w, c, _ in log if w == "a" and c == 429),
            "b_requests": sum(1 for _, w, _, _ in log if w == "b"),
            "b_refused": sum(1 for _, w, c, _ in log if w == "b" and c != 200),
            "b_admitted_tokens_steady_minute": admitted("b", warm, warm + 60),
            "timeline": [[round(t, 2), w, c, u] for t, w, c, u in log]}


def fake_engine_process(port: int, num_chunks: int, chunk_delay: float) -> subprocess.Popen[bytes]:
    code = ("import sys, uvicorn; sys.path.insert(0, 'tests/gateway'); "
            "from gateway_support import FakeEngine; "
            f"uvicorn.run(FakeEngine(num_chunks={num_chunks}, chunk_delay={chunk_delay}).app(), "
            f"host='127.0.0.1', port={port}, log_level='warning', backlog=4096)")
    return subprocess.Popen([PY, "-c", code], cwd=ROOT)


async def ttfts(url: str, n: int) -> list[float]:
    async with httpx.AsyncClient(timeout=30) as c:
        await one_request(c, url, "tiny", "warm up", 4)
        return [(await one_request(c, url, "tiny", f"hello {i}", 4)).ttft for i in range(n)]


async def many_streams(url: str, n: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as c:
        started = time.perf_counter()
        samples = await asyncio.gather(*(one_request(c, url, "tiny", f"s {i}", 10)
                                         for i in range(n)))
        wall = time.perf_counter() - started
    errors = [s.error or "empty" for s in samples if not s.ok]
    return {"streams": n, "errors": len(errors), "error_kinds": sorted(set(errors)),
            "wall_seconds": wall, "ttft_p50": pct([s.ttft for s in samples if s.ok], 50)}


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    engine_port, slow_port, gw_port = free_port(), free_port(), free_port()
    procs = [fake_engine_process(engine_port, 4, 0.0),
             fake_engine_process(slow_port, 10, 0.5)]
    engine, slow = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{slow_port}"
    try:
        for url, proc in ((engine, procs[0]), (slow, procs[1])):
            wait_ready(url, proc, timeout=60)
        gw = subprocess.Popen([str(Path(sys.executable).parent / "kvasir-gateway"), "--host", "127.0.0.1",
                               "--port", str(gw_port), "--backend", engine, "--log-level",
                               "warning"])
        procs.append(gw)
        wait_ready(f"http://127.0.0.1:{gw_port}", gw, timeout=60)
        direct = asyncio.run(ttfts(engine, args.overhead_requests))
        through = asyncio.run(ttfts(f"http://127.0.0.1:{gw_port}", args.overhead_requests))
        gw.terminate()
        gw.wait(timeout=30)
        gw2 = subprocess.Popen([str(Path(sys.executable).parent / "kvasir-gateway"), "--host", "127.0.0.1",
                                "--port", str(gw_port), "--backend", slow, "--log-level",
                                "warning"])
        procs.append(gw2)
        wait_ready(f"http://127.0.0.1:{gw_port}", gw2, timeout=60)
        streams = asyncio.run(many_streams(f"http://127.0.0.1:{gw_port}", args.streams))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    return {"requests": args.overhead_requests, "direct_ttft_p50_ms": pct(direct, 50) * 1000,
            "gateway_ttft_p50_ms": pct(through, 50) * 1000,
            "added_ttft_p50_ms": (pct(through, 50) - pct(direct, 50)) * 1000,
            "concurrent_streams": streams}


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    if "routing" in result:
        pol = result["routing"]["policies"]
        names = list(pol)
        axes[0].bar(names, [pol[n]["ttft_p50"] for n in names], color="tab:blue")
        axes[0].set_ylabel("TTFT p50 (s)")
        twin = axes[0].twinx()
        twin.plot(names, [pol[n]["hit_rate_vs_oracle"] for n in names], "o-", color="tab:red")
        twin.set_ylabel("prefix hit rate / oracle's", color="tab:red")
        twin.set_ylim(0, 1.05)
        axes[0].set_title("routing")
    if "quota" in result:
        q = result["quota"]
        for tenant, color in (("a", "tab:orange"), ("b", "tab:green")):
            points = [(t, u) for t, w, _, u in q["timeline"] if w == tenant]
            xs, total, ys = [], 0, []
            for t, u in points:
                total += u
                xs.append(t)
                ys.append(total)
            axes[1].plot(xs, ys, color=color, label=f"tenant {tenant} (cumulative tokens)")
        lo, hi = q["window_seconds"]
        axes[1].axvspan(lo, hi, alpha=0.1)
        axes[1].set_xlabel("s")
        axes[1].set_title(f"quota {q['quota_tpm']} tok/min, two gateways, one Redis")
        axes[1].legend()
    if "overhead" in result:
        o = result["overhead"]
        axes[2].bar(["direct", "gateway"], [o["direct_ttft_p50_ms"], o["gateway_ttft_p50_ms"]])
        axes[2].set_ylabel("TTFT p50 (ms), fake engine")
        s = o["concurrent_streams"]
        axes[2].set_title(f"overhead; {s['streams']} streams: {s['errors']} errors")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway")
    p.add_argument("--parts", default="overhead,quota,routing")
    p.add_argument("--replicas", type=int, default=2,
                   help="engine replicas (default: one a core on a 2-core host)")
    p.add_argument("--policies", default="round_robin,least_load,prefix,precise",
                   help="routing policies compared, in this order")
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="the routing workload's requests")
    p.add_argument("--rounds", type=int, default=3,
                   help="routing: rounds of every policy (order rotated), samples pooled")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16,
                   help="clients in a closed loop (at 8 on two replicas one request is 25%% of "
                        "a replica's mean, so the balance ratio moves in steps of 0.25)")
    p.add_argument("--kv-cache-memory", default="128MiB")
    p.add_argument("--load-bound", type=float, default=GatewayConfig.load_bound,
                   help="the gateway's --load-bound (CHWBL's epsilon)")
    p.add_argument("--prefix-miss-weight", type=float, default=GatewayConfig.prefix_miss_weight,
                   help="the gateway's --prefix-miss-weight")
    p.add_argument("--load-tokens-per-request", type=float,
                   default=GatewayConfig.load_tokens_per_request,
                   help="the gateway's --load-tokens-per-request")
    p.add_argument("--engine-threads", type=int, default=1, help="OMP threads of each engine")
    p.add_argument("--quota-tpm", type=int, default=30_000)
    p.add_argument("--quota-seconds", type=float, default=90.0)
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument("--streams", type=int, default=1000)
    args = p.parse_args()
    parts = args.parts.split(",")
    result: dict[str, Any] = {"host_cpu": host_line()}
    with tempfile.TemporaryDirectory() as d:
        if "overhead" in parts:
            result["overhead"] = bench_overhead(args)
            print("overhead", json.dumps(result["overhead"]), flush=True)
        if "quota" in parts:
            result["quota"] = bench_quota(args, Path(d))
            print("quota", json.dumps({k: v for k, v in result["quota"].items()
                                       if k != "timeline"}), flush=True)
        if "routing" in parts:
            result["routing"] = bench_routing(args, Path(d))
    write_results(result, args.out, plot)


if __name__ == "__main__":
    main()
