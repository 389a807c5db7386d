"""Cascade benchmark, every process on 127.0.0.1; one JSON and one PNG.

Two pools of the default model (SmolLM2-135M-Instruct) configured differently: "small" with
int4 weights, "large" with bfloat16 ones, each a real `kvasir-engine` process. A workload mixing
easy questions (one fact, short answer) and hard ones (reasoning, code) goes through the gateway
three ways, each with its own gateway:

1. always-large: `model: large`;
2. always-small: an alias whose default is the small pool (not shadowed: on one host the shadows
   would take CPU from the small pool and understate the rate that prices its tokens);
3. cascade: an alias `auto` with `cascade: [small, large]` escalating under `--min-mean-logprob`;
4. cascade_shadowed: the same, the small answers it kept shadowed to the large pool
   (`--shadow-fraction`): the measured disagreement rate. Its latency is not the cascade's own on
   one host (the shadows load the large pool and take CPU from the small one), hence way 3.

Reported per way: cost per request (output tokens at each pool's cost per token, which is
`--*-cost-per-hour` over the pool's own output tokens/s measured in phases 1 and 2; for the
cascade the gateway's `kvasir_gateway_cascade_cost_total`, which counts the escalated small
attempts too, with its `always_large` estimate beside it), p50/p95
latency of the whole (non-streamed) request, the share answered by the small pool, escalations,
and the measured disagreement rate (shadows that disagreed / shadows compared). The prices are
notional: on one CPU host they only stand for "the small pool is cheaper".

    flock /tmp/kvasir-cpu.lock .venv/bin/python bench/cascade.py --out bench/results/cascade
    .venv/bin/python bench/cascade.py --requests 8      # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from results import write_results
from serving import pct

from gateway import wait_ready

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gateway"))
from gateway_support import Served, free_port  # noqa: E402
from kvasir_gateway.aliases import parse_routing  # noqa: E402
from kvasir_gateway.app import create_app  # noqa: E402
from kvasir_gateway.config import GatewayConfig  # noqa: E402

EASY = ["What is the capital of France?", "How many days are in a week?",
        "What color is the sky on a clear day?", "Name the largest ocean on Earth.",
        "What is 2 + 2?", "Which animal says 'moo'?", "What is the opposite of hot?",
        "How many legs does a spider have?"]
HARD = ["Explain step by step why the square root of 2 is irrational.",
        "Write a Python function that returns the longest palindromic substring, and explain "
        "its complexity.",
        "Compare the trade-offs of optimistic and pessimistic locking in databases.",
        "Derive the formula for the sum of the first n odd numbers.",
        "Why does a paged KV cache reduce memory fragmentation in LLM serving? Be precise.",
        "Analyze the causes of the 2008 financial crisis in three short points."]


def start_engine(name: str, flags: list[str], port: int, log: Path,
                 threads: int) -> subprocess.Popen[bytes]:
    binary = Path(sys.executable).with_name("kvasir-engine")
    return subprocess.Popen(
        [str(binary), "serve", "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", name, "--max-model-len", "1024", *flags],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"),
        env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def workload(rng: random.Random, n: int, hard_share: float) -> list[tuple[str, str]]:
    return [("hard", rng.choice(HARD)) if rng.random() < hard_share else ("easy", rng.choice(EASY))
            for _ in range(n)]


async def run_way(gw: Served, model: str, work: list[tuple[str, str]], max_tokens: int,
                  concurrency: int) -> list[dict[str, Any]]:
    queue = list(reversed(work))
    out: list[dict[str, Any]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            kind, question = queue.pop()
            started = time.perf_counter()
            resp = await client.post(gw.url + "/v1/chat/completions", json={
                "model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": question}]})
            out.append({"kind": kind, "ok": resp.status_code == 200,
                        "seconds": time.perf_counter() - started,
                        "model": resp.headers.get("x-kvasir-model", ""),
                        "escalated": "x-kvasir-escalations" in resp.headers,
                        "completion_tokens": resp.json().get("usage", {}).get(
                            "completion_tokens", 0) if resp.status_code == 200 else 0})

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return out


def counter(gw: Served, name: str, **labels: str) -> float:
    value = gw.app.state.gateway.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


def serve_way(urls: list[str], table: dict[str, Any], model: str, work: list[tuple[str, str]],
              args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, float]]:
    config = GatewayConfig(host="127.0.0.1", port=0, backends=tuple(urls),
                           probe_interval_seconds=0.5, routing_table=parse_routing(table))
    with Served(create_app(config)) as gw:
        wait_ready(gw.url, None)
        started = time.perf_counter()
        rows = asyncio.run(run_way(gw, model, work, args.max_tokens, args.concurrency))
        wall = time.perf_counter() - started
        deadline = time.monotonic() + 600  # the shadows finish before the gateway stops
        while gw.app.state.shadows.tasks and time.monotonic() < deadline:
            time.sleep(0.2)
        shadows = {o: counter(gw, "kvasir_gateway_shadow_comparisons_total", alias=model,
                              rule="default", outcome=o) for o in ("agree", "disagree")}
        costs = {k: counter(gw, "kvasir_gateway_cascade_cost_total", alias=model, kind=k)
                 for k in ("actual", "always_large")}
    return rows, {"wall_seconds": wall, **shadows, **costs}


def summarize(rows: list[dict[str, Any]], stats: dict[str, float],
              price_per_token: dict[str, float]) -> dict[str, Any]:
    good = [r for r in rows if r["ok"]]
    # The answers' tokens; a cascade's escalated attempts cost too: the gateway counted them.
    cost = stats["actual"] or sum(r["completion_tokens"] * price_per_token[r["model"]]
                                  for r in good)
    compared = stats["agree"] + stats["disagree"]
    return {"requests": len(rows), "errors": len(rows) - len(good),
            "latency_p50": pct([r["seconds"] for r in good], 50),
            "latency_p95": pct([r["seconds"] for r in good], 95),
            "small_share": sum(r["model"] == "small" for r in good) / max(1, len(good)),
            "escalations": sum(r["escalated"] for r in good),
            # what escalating costs the client: the escalated requests' latency apart
            "escalated_latency_p50": pct([r["seconds"] for r in good if r["escalated"]], 50),
            "escalated_latency_max": max((r["seconds"] for r in good if r["escalated"]),
                                         default=float("nan")),
            "not_escalated_latency_p95": pct([r["seconds"] for r in good if not r["escalated"]],
                                             95),
            "output_tokens": sum(r["completion_tokens"] for r in good),
            "cost_per_request": cost / max(1, len(good)),
            "shadows_compared": compared,
            "disagreement_rate": stats["disagree"] / compared if compared else float("nan"),
            "wall_seconds": stats["wall_seconds"],
            "gateway_always_large_cost_per_request": stats["always_large"] / max(1, len(good))}


def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ports = {"small": free_port(), "large": free_port()}
    flags = {"small": ["--quantization", args.small_quantization],
             "large": ["--dtype", "bfloat16"]}
    procs = {name: start_engine(name, flags[name], port, tmp / f"{name}.log", args.engine_threads)
             for name, port in ports.items()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    work = workload(random.Random(args.seed), args.requests, args.hard_share)
    shadow = {"fraction": args.shadow_fraction, "max_concurrent": args.shadow_max_concurrent}
    price = {"small": args.small_cost_per_hour, "large": args.large_cost_per_hour}
    try:
        for name, proc in procs.items():
            wait_ready(urls[name], proc)
        backends = list(urls.values())
        raw: dict[str, Any] = {}
        tokens_per_second: dict[str, float] = {}
        cascade = {"cascade": ["small", "large"],
                   "checks": {"min_mean_logprob": args.min_mean_logprob, "length": False}}
        ways = [("always_large", "large", {}),
                # no shadows here: on one host they would share the CPU with the small pool
                # and understate its rate, which prices its tokens
                ("always_small", "small-only", {"small-only": {"default": "small"}}),
                ("cascade", "auto", {"auto": cascade}),
                # the same cascade shadowed: the router's errors; on one host its shadows load
                # the large pool and take CPU from the small one, so its latency is not the
                # cascade's own
                ("cascade_shadowed", "auto", {"auto": {**cascade, "shadow": shadow}})]
        for way, model, aliases in ways:
            # priced from the rates measured so far (always-large and always-small come first)
            pools = {p: {"cost_per_hour": price[p], "full_load_tokens_per_second": tps}
                     for p, tps in tokens_per_second.items() if tps > 0}
            rows, stats = serve_way(backends, {"aliases": aliases, "pools": pools}, model, work,
                                    args)
            raw[way] = (rows, stats)
            if not way.startswith("cascade"):  # each pool's own rate, alone (no shadows)
                pool = "large" if way == "always_large" else "small"
                tokens = sum(r["completion_tokens"] for r in rows if r["ok"])
                tokens_per_second[pool] = tokens / stats["wall_seconds"]
            print(way, stats, flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
    price_per_token = {p: price[p] / (tokens_per_second[p] * 3600) if tokens_per_second[p]
                       else float("nan") for p in price}
    result: dict[str, Any] = {
        "requests": args.requests, "hard_share": args.hard_share,
        "small_quantization": args.small_quantization,
        "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "min_mean_logprob": args.min_mean_logprob, "shadow_fraction": args.shadow_fraction,
        "cost_per_hour": price, "output_tokens_per_second": tokens_per_second,
        "cost_per_million_output_tokens": {p: v * 1e6 for p, v in price_per_token.items()},
        "ways": {way: summarize(rows, stats, price_per_token)
                 for way, (rows, stats) in raw.items()}}
    large = result["ways"]["always_large"]["cost_per_request"]
    result["cascade_cost_vs_always_large"] = (
        result["ways"]["cascade"]["cost_per_request"] / large if large else float("nan"))
    return result


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = list(result["ways"])
    fig, (cost_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4))
    costs = [result["ways"][w]["cost_per_request"] for w in ways]
    cost_ax.bar(ways, costs, color=["tab:red", "tab:green", "tab:blue", "tab:purple"][:len(ways)])
    for i, w in enumerate(ways):
        rate = result["ways"][w]["disagreement_rate"]
        if rate == rate:  # not NaN: this way was shadowed
            cost_ax.annotate(f"disagree {rate:.0%}", (i, costs[i]), ha="center",
                             va="bottom", fontsize=9)
    cost_ax.set_ylabel("cost per request (notional units)")
    cost_ax.set_title("Cost per request")
    x = range(len(ways))
    lat_ax.bar([i - 0.2 for i in x], [result["ways"][w]["latency_p50"] for w in ways], 0.4,
               label="p50")
    lat_ax.bar([i + 0.2 for i in x], [result["ways"][w]["latency_p95"] for w in ways], 0.4,
               label="p95")
    lat_ax.set_xticks(list(x), ways)
    lat_ax.set_ylabel("seconds")
    lat_ax.set_title("Request latency")
    lat_ax.legend()
    fig.suptitle(f"Cascade {result['small_quantization']} -> bfloat16, {result['requests']} requests, "
                 f"{result['hard_share']:.0%} hard")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cascade")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--hard-share", type=float, default=0.3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--min-mean-logprob", type=float, default=-1.0)
    p.add_argument("--shadow-fraction", type=float, default=1.0)
    p.add_argument("--shadow-max-concurrent", type=int, default=16,
                   help="shadows at once; more are dropped (and not compared)")
    p.add_argument("--small-cost-per-hour", type=float, default=1.0)
    p.add_argument("--large-cost-per-hour", type=float, default=4.0)
    p.add_argument("--engine-threads", type=int, default=1, help="OMP threads of each engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small-quantization", choices=("int4", "int8"), default="int4",
                   help="the small pool's weights (int8 is the faster one on some CPUs)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = bench(args, Path(tmp))
    write_results(result, args.out, plot)


if __name__ == "__main__":
    main()
