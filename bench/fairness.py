"""Fair share benchmark: does a flooding tenant delay a light tenant's first tokens?

Starts a real engine server on 127.0.0.1 once per scheduling policy (`fair`, `fcfs`), with two
tenants' API keys (`--api-key-file` with `light:KEY` and `heavy:KEY` lines), and drives it with
an open loop of streaming `/v1/completions` requests at seeded Poisson arrival times:

0. warm-up: `--warmup` seconds of the flood's load, not measured;
1. solo: the light tenant alone at `--light-rate` requests/s for `--duration` seconds;
2. flood: the same light load plus the heavy tenant at `--ratio` (10) times its rate, enough to
   overload the server, so the heavy tenant's requests queue.

It reports the light tenant's TTFT p50/p95 solo and under the flood, their ratio (the issue's
target: at most 1.5x with `fair`, while `fcfs` shows the damage), the heavy tenant's TTFT, and
the output tokens/s streamed during the flood's arrival window (target: fair within 5% of
fcfs). A request still without its first token when the drain time is over is cancelled and
counted with the time it had waited (a lower bound), so an unbounded FCFS queue is not hidden.

    flock /tmp/kvasir-cpu.lock python bench/fairness.py --out bench/results/fairness

Each policy runs `--rounds` times (other seeds, the order alternating), samples pooled. The
host's other processes are measured too (CPU share they took during each phase): on a shared
machine they, not the policy, can make a solo phase slow.

Writes fairness.json and fairness.png (results.write_results).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import shlex
import sys
import time
from itertools import accumulate
from pathlib import Path
from typing import Any

import httpx
from results import write_results
from serving import Sample, make_prompts, one_request, pct, start, stop, wait_ready

POLICIES = ("fair", "fcfs")
# A per-tenant waiting bound, so the flood is refused (429) before it fills the shared queue
# and the light tenant is refused too: what is compared is the scheduler's order alone.
DEFAULT_SERVER_ARGS = ("--max-model-len 2048 --quantization int8 --kv-cache-dtype bfloat16 "
                       "--max-num-seqs 16 --max-waiting-seqs-per-tenant 32")


def arrival_times(rng: random.Random, rate: float, duration: float) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def open_loop(url: str, keys: dict[str, str], tenant_to_rate: dict[str, float],
                    duration: float, drain: float, max_tokens: int, words: tuple[int, int],
                    seed: int, prompt_seed: int) -> dict[str, list[tuple[float, Sample]]]:
    """Every tenant's requests at their arrival times; (arrival offset, sample) per request.

    A tenant's arrival times depend on `seed` alone (the same in every phase and policy), its
    prompts on `prompt_seed` too (no phase finds another's prompts in the prefix cache).
    """
    out: dict[str, list[tuple[float, Sample]]] = {tenant: [] for tenant in tenant_to_rate}
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=100)
    clients = {tenant: httpx.AsyncClient(timeout=httpx.Timeout(duration + drain + 60),
                                         limits=limits,
                                         headers={"Authorization": f"Bearer {keys[tenant]}"})
               for tenant in tenant_to_rate}
    t0 = time.perf_counter()

    async def one(tenant: str, at: float, prompt: str) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        started = time.perf_counter() - t0
        sample = Sample(ok=False)
        try:
            await asyncio.wait_for(one_request(clients[tenant], url, None, prompt, max_tokens,
                                               sample), timeout=max(1.0, duration + drain - started))
        except TimeoutError:  # cancelled: the client disconnects, the server aborts
            sample.error = "drain timeout"
        if not sample.ttft:  # no first token: what it waited is a lower bound of its TTFT
            sample.ttft = time.perf_counter() - t0 - started
            sample.itls = []
            sample.num_output_tokens = -1
        out[tenant].append((started, sample))

    tasks = []
    for index, (tenant, rate) in enumerate(sorted(tenant_to_rate.items())):
        rng = random.Random(seed * 100 + index)
        times = arrival_times(rng, rate, duration)
        prompts = make_prompts(prompt_seed * 100 + index, len(times), *words)
        tasks += [one(tenant, at, prompt) for at, prompt in zip(times, prompts, strict=True)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for client in clients.values():
            await client.aclose()
    return out


def summarize(samples: list[tuple[float, Sample]], window: float) -> dict[str, Any]:
    """TTFT percentiles (waits of cancelled requests included) and tokens streamed in window."""
    first_token = [s.ttft for _, s in samples if s.ok or s.error == "drain timeout"]
    tokens_in_window = 0
    for started, s in samples:
        if s.num_output_tokens >= 0 and s.ttft:  # first token at ttft, then the gaps
            times = accumulate([started + s.ttft, *s.itls])
            tokens_in_window += sum(1 for t in times if t <= window)
    errors = sorted({s.error for _, s in samples if not s.ok})
    # The server's own account (completed requests): arrival -> first token, and the queue
    # part of it (arrival -> first scheduled); the rest of the client's TTFT is HTTP and the
    # client itself.
    engine_ttft = [s.engine_ttft for _, s in samples if s.ok and s.engine_ttft is not None]
    engine_queue = [s.engine_queue for _, s in samples if s.ok and s.engine_queue is not None]
    return {"requests": len(samples), "completed": sum(s.ok for _, s in samples),
            "cancelled_at_drain": sum(s.error == "drain timeout" for _, s in samples),
            "errors": errors, "ttft_p50": pct(first_token, 50), "ttft_p95": pct(first_token, 95),
            "ttft_max": max(first_token, default=float("nan")),
            "engine_ttft_p50": pct(engine_ttft, 50), "engine_ttft_p95": pct(engine_ttft, 95),
            "engine_queue_p50": pct(engine_queue, 50), "engine_queue_p95": pct(engine_queue, 95),
            "tokens_in_window": tokens_in_window,
            "ttft_by_arrival": [[round(started, 3), round(s.ttft, 4)] for started, s in samples
                                if s.ok or s.error == "drain timeout"]}


def busy_cpu_seconds(pid: int) -> tuple[float, float]:
    """(CPU seconds the whole host has been busy, those of process `pid` and its children)."""
    tick = os.sysconf("SC_CLK_TCK")
    host = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    proc = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (sum(host) - host[3] - host[4]) / tick, sum(int(x) for x in proc[11:15]) / tick


def run_policy(policy: str, round_index: int, a: argparse.Namespace, keys: dict[str, str],
               key_file: Path) -> dict[str, dict[str, Any]]:
    """One server run: warm-up, then each phase's samples, tokens/s and the CPU time that
    other processes on the host took meanwhile (`foreign_cpu_share`: of all cores)."""
    url = f"http://127.0.0.1:{a.port}"
    cmd = (f"{a.engine} serve --host 127.0.0.1 --port {a.port} --api-key-file {key_file} "
           f"--scheduling-policy {policy} {a.server_args}")
    proc = start(cmd, a.out.parent / f"{a.out.name}-{policy}-{round_index}.log")
    seed = a.seed + round_index
    try:
        wait_ready(url, proc)
        words = tuple(int(w) for w in a.prompt_words.split(","))
        phases = {"solo": {"light": a.light_rate},
                  "flood": {"light": a.light_rate, "heavy": a.light_rate * a.ratio}}
        # Warm-up: the flood's mix for a while, discarded (first calls of each shape are slow).
        asyncio.run(open_loop(url, keys, phases["flood"], a.warmup, a.drain, a.max_tokens,
                              (words[0], words[1]), seed + 1000, seed * 10))
        result: dict[str, dict[str, Any]] = {}
        for phase_index, (phase, rates) in enumerate(phases.items()):
            start_time, (host0, server0) = time.perf_counter(), busy_cpu_seconds(proc.pid)
            self0 = sum(os.times()[:2])
            samples = asyncio.run(open_loop(url, keys, rates, a.duration, a.drain, a.max_tokens,
                                            (words[0], words[1]), seed,
                                            seed * 10 + phase_index + 1))
            host1, server1 = busy_cpu_seconds(proc.pid)
            foreign = (host1 - host0) - (server1 - server0) - (sum(os.times()[:2]) - self0)
            share = foreign / ((time.perf_counter() - start_time) * (os.cpu_count() or 1))
            tokens = sum(summarize(s, a.duration)["tokens_in_window"] for s in samples.values())
            result[phase] = {"samples": samples, "output_tokens_per_s": tokens / a.duration,
                             "foreign_cpu_share": max(0.0, share)}
            print(f"round {round_index} {policy:4s} {phase:5s} "
                  f"{tokens / a.duration:6.1f} out tok/s, other processes took "
                  f"{100 * share:.0f}% of the CPUs", flush=True)
        return result
    finally:
        stop(proc)


def pooled(runs: list[dict[str, dict[str, Any]]], duration: float) -> dict[str, Any]:
    """Every round's samples of one policy pooled per phase and tenant, throughput averaged."""
    out: dict[str, Any] = {}
    for phase in ("solo", "flood"):
        tenants = runs[0][phase]["samples"]
        summary = {tenant: summarize([x for run in runs for x in run[phase]["samples"][tenant]],
                                     duration) for tenant in tenants}
        rates = [run[phase]["output_tokens_per_s"] for run in runs]
        shares = [run[phase]["foreign_cpu_share"] for run in runs]
        out[phase] = {**summary, "output_tokens_per_s": sum(rates) / len(rates),
                      "output_tokens_per_s_by_round": rates, "foreign_cpu_share_by_round": shares}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    xs = range(len(runs))
    for offset, phase in ((-0.2, "solo"), (0.2, "flood")):
        ax1.bar([x + offset for x in xs], [runs[p][phase]["light"]["ttft_p95"] for p in runs],
                width=0.4, label=f"light, {phase}")
    ax1.set_xticks(list(xs), list(runs))
    ax1.set(ylabel="TTFT p95 (s)", yscale="log", title="light tenant's TTFT p95")
    for policy, run in runs.items():
        points = run["flood"]["light"]["ttft_by_arrival"]
        ax2.scatter([p[0] for p in points], [p[1] for p in points], s=9, label=f"{policy}: light")
    ax2.set(xlabel="arrival (s into the flood)", ylabel="TTFT (s)", yscale="log",
            title="light tenant under a 10x flood")
    ax3.bar(list(xs), [runs[p]["flood"]["output_tokens_per_s"] for p in runs])
    ax3.set_xticks(list(xs), list(runs))
    ax3.set(ylabel="output tokens/s", title="throughput during the flood")
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default=f"{Path(sys.executable).parent}/kvasir-engine")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS)
    p.add_argument("--port", type=int, default=8150)
    p.add_argument("--policies", default=",".join(POLICIES))
    # The flood must overload the server, or FCFS shows no damage and the ratio says nothing:
    # 3/s (heavy 30/s, ~1,060 output tok/s asked) does on a 2-core AVX-512 host serving
    # ~720-840 tok/s with the 2026-12-05 kernels; 2/s no longer did (FCFS's light p95 2.2x its
    # solo value), as 1/s had stopped doing before (docs/performance.md, fair share).
    p.add_argument("--light-rate", type=float, default=3.0, help="light requests per second")
    p.add_argument("--ratio", type=float, default=10.0, help="heavy rate / light rate")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a phase")
    p.add_argument("--warmup", type=float, default=15.0,
                   help="seconds of the flood's load first, not measured")
    p.add_argument("--drain", type=float, default=90.0,
                   help="seconds after the arrivals before unfinished requests are cancelled")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", default="20,40", help="min,max words per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2,
                   help="server runs per policy (other seeds), samples pooled")
    p.add_argument("--out", type=Path, default=Path("bench/results/fairness"))
    a = p.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    keys = {tenant: f"sk-{tenant}-{secrets.token_hex(8)}" for tenant in ("light", "heavy")}
    key_file = a.out.parent / f"{a.out.name}-keys.txt"
    key_file.write_text("".join(f"{tenant}:{key}\n" for tenant, key in keys.items()))
    policies = a.policies.split(",")
    by_policy: dict[str, list[dict[str, dict[str, Any]]]] = {p: [] for p in policies}
    try:
        for round_index in range(a.rounds):  # alternate the order: noise hits both alike
            for policy in policies if round_index % 2 == 0 else policies[::-1]:
                by_policy[policy].append(run_policy(policy, round_index, a, keys, key_file))
    finally:
        key_file.unlink()
    runs: dict[str, Any] = {policy: pooled(r, a.duration) for policy, r in by_policy.items()}
    for policy, run in runs.items():
        for phase in ("solo", "flood"):
            light = run[phase]["light"]
            print(f"{policy:4s} {phase:5s} light TTFT p50/p95 {light['ttft_p50']:.3f}/"
                  f"{light['ttft_p95']:.3f}s (server's: {light['engine_ttft_p50']:.3f}/"
                  f"{light['engine_ttft_p95']:.3f}s, queued {light['engine_queue_p50']:.3f}/"
                  f"{light['engine_queue_p95']:.3f}s; "
                  f"{light['completed']}/{light['requests']} done) | "
                  f"{run[phase]['output_tokens_per_s']:.1f} out tok/s")
    verdict: dict[str, object] = {}
    for policy, run in runs.items():
        solo, flood = run["solo"]["light"]["ttft_p95"], run["flood"]["light"]["ttft_p95"]
        verdict[f"{policy}_light_ttft_p95_ratio"] = flood / solo
    if {"fair", "fcfs"} <= runs.keys():
        verdict["fair_over_fcfs_throughput"] = (runs["fair"]["flood"]["output_tokens_per_s"]
                                                / runs["fcfs"]["flood"]["output_tokens_per_s"])
    print(" ".join(f"{k}={v:.3f}" for k, v in verdict.items()))
    report = {"command": " ".join(shlex.quote(x) for x in sys.argv),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
              "verdict": verdict, "runs": runs}
    write_results(report, a.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
