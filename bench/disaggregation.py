"""Disaggregated prefill/decode against one colocated engine, on the same cores, the same workload.

Two set-ups, started and measured in turn (order alternated between rounds):

- **colocated**: one `kvasir-engine serve` on every core of `--cores` (e.g. 0,1);
- **disaggregated**: a producer (`kv_producer`) pinned with `taskset` to the first core and a
  consumer (`kv_consumer`) to the others; long prompts go to the producer first and their KV
  blocks to the consumer, which decodes (vLLM's two requests, sent by this client or, with
  `--route gateway`, by `kvasir-gateway` in front of both: its two-stage routing decides).

Each set-up runs two phases of `--duration` seconds on a fresh server: **quiet**, where
`--decode-streams` clients stream short-prompt requests back to back (closed loop), and
**arrivals**, the same plus long prompts (`--long-prompt-tokens`, 2,000-6,000 by default)
arriving as a seeded Poisson process (mean gap `--long-interval`). Reported per phase: the decode
streams' inter-token latency p50/p99 and their longest stall, TTFT p50/p95 of the long prompts
(from their arrival: the producer's prefill, the transfer and the consumer's first token), and
output tokens/s over everything; for the disaggregated set-up also the bytes and seconds per
transfer (the consumer's `kvasir:kv_transfer_*` metrics) and the fallbacks. Last, a probe: one
`--probe-tokens` prompt alone, its prefill time on the producer against its transfer time.

    python bench/disaggregation.py --rounds 2 --duration 60 --out bench/results/disaggregation

Targets (issue 33): decode ITL p99 with arrivals <= 1.5x without them (disaggregated), output
tokens/s >= 0.8x colocated, transfer of the probe <= 25% of its prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from results import host_line, write_results
from serving import (
    ROOT,
    Job,
    Sample,
    make_workload,
    one_request,
    pair,
    pct,
    start,
    stop,
    token_counter,
    wait_ready,
)

ENGINE = ROOT / ".venv" / "bin" / "kvasir-engine"
GATEWAY = ROOT / ".venv" / "bin" / "kvasir-gateway"
PORTS = {"colocated": 8401, "producer": 8402, "consumer": 8403, "gateway": 8404}
KV_PORT = 14601


@dataclass
class Setup:
    name: str
    commands: dict[str, str]  # role -> command line
    urls: dict[str, str]  # role -> base URL
    model: str | None = None  # the model field to send (the gateway routes by it)

    @property
    def decode_url(self) -> str:
        return self.urls.get("gateway") or self.urls.get("consumer") or self.urls["colocated"]


def setups(cores: list[int], max_model_len: int, route: str, extra_args: str,
           gateway_args: str) -> list[Setup]:
    common = f"serve --host 127.0.0.1 --max-model-len {max_model_len} {extra_args}".strip()
    all_cores = ",".join(map(str, cores))
    rest = ",".join(map(str, cores[1:]))
    producer = json.dumps({"kv_connector": "TCPConnector", "kv_role": "kv_producer",
                           "kv_ip": "127.0.0.1", "kv_port": KV_PORT})
    consumer = json.dumps({"kv_connector": "TCPConnector", "kv_role": "kv_consumer"})
    colocated = Setup("colocated", {
        "colocated": f"taskset -c {all_cores} {ENGINE} {common} --port {PORTS['colocated']}"},
        {"colocated": f"http://127.0.0.1:{PORTS['colocated']}"})
    disagg = Setup("disaggregated", {
        "producer": (f"taskset -c {cores[0]} {ENGINE} {common} --port {PORTS['producer']} "
                     f"--kv-transfer-config {shlex.quote(producer)}"),
        "consumer": (f"taskset -c {rest} {ENGINE} {common} --port {PORTS['consumer']} "
                     f"--kv-transfer-config {shlex.quote(consumer)}")},
        {"producer": f"http://127.0.0.1:{PORTS['producer']}",
         "consumer": f"http://127.0.0.1:{PORTS['consumer']}"})
    if route == "gateway":
        # The gateway shares the consumer's cores: it is part of the decode path.
        disagg.commands["gateway"] = (
            f"taskset -c {rest} {GATEWAY} --host 127.0.0.1 --port {PORTS['gateway']} "
            f"--backend {disagg.urls['producer']} --backend {disagg.urls['consumer']} "
            f"{gateway_args}").strip()
        disagg.urls["gateway"] = f"http://127.0.0.1:{PORTS['gateway']}"
    return [colocated, disagg]


@dataclass
class LongResult:
    sample: Sample
    prompt_tokens: int
    prefill_call_seconds: float = 0.0  # the producer's answer, wall (0: no remote prefill)
    producer_prefill_seconds: float = 0.0  # the producer's own prefill timing
    ttft: float = 0.0  # arrival -> first token


@dataclass
class Phase:
    decode: list[Sample] = field(default_factory=list)
    long: list[LongResult] = field(default_factory=list)
    wall: float = 0.0


async def remote_prefill(client: httpx.AsyncClient, producer: str, job: Job
                         ) -> tuple[dict[str, object] | None, float, float]:
    """vLLM's proxy's first request: (kv_transfer_params for the consumer, wall seconds, the
    producer's prefill seconds); params None when the producer failed (the consumer prefills)."""
    began = time.perf_counter()
    resp = await client.post(f"{producer}/v1/completions", json={
        "prompt": job.prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}})
    wall = time.perf_counter() - began
    if resp.status_code != 200:
        print(f"producer answered {resp.status_code}: {resp.text[:200]}", file=sys.stderr)
        return None, wall, 0.0
    answer = resp.json()
    timings = answer.get("kvasir") or {}
    return answer.get("kv_transfer_params"), wall, float(timings.get("prefill_seconds", 0.0))


async def run_long(client: httpx.AsyncClient, setup: Setup, job: Job, prompt_tokens: int,
                   via_client: bool) -> LongResult:
    arrival = time.perf_counter()
    result = LongResult(Sample(ok=False), prompt_tokens)
    extra: dict[str, object] | None = None
    if via_client and "producer" in setup.urls:
        params, result.prefill_call_seconds, result.producer_prefill_seconds = (
            await remote_prefill(client, setup.urls["producer"], job))
        extra = {"kv_transfer_params": params} if params else None
    decode_start = time.perf_counter()
    await one_request(client, setup.decode_url, setup.model, job.prompt, job.max_tokens,
                      result.sample, extra)
    result.ttft = decode_start - arrival + result.sample.ttft
    return result


async def run_phase(setup: Setup, decode_jobs: list[Job], long_jobs: list[tuple[float, Job, int]],
                    streams: int, duration: float, via_client: bool) -> Phase:
    phase = Phase()
    queue = list(reversed(decode_jobs))
    limits = httpx.Limits(max_connections=streams + len(long_jobs) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        await one_request(client, setup.decode_url, setup.model, "warm up", 4)
        began = time.perf_counter()
        deadline = began + duration

        async def decoder() -> None:
            while queue and time.perf_counter() < deadline:
                job = queue.pop()
                phase.decode.append(await one_request(client, setup.decode_url, setup.model,
                                                      job.prompt, job.max_tokens))

        async def arrivals() -> None:
            tasks = []
            for at, job, tokens in long_jobs:
                delay = began + at - time.perf_counter()
                if began + at >= deadline:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run_long(client, setup, job, tokens,
                                                          via_client)))
            phase.long.extend(await asyncio.gather(*tasks))

        await asyncio.gather(arrivals(), *(decoder() for _ in range(streams)))
        phase.wall = time.perf_counter() - began
    if len(queue) == 0:
        print("warning: the decode workload ran out before the phase's end", file=sys.stderr)
    return phase


def summarize(phase: Phase) -> dict[str, float]:
    decode_ok = [s for s in phase.decode if s.ok]
    long_ok = [r for r in phase.long if r.sample.ok]
    itl = [x for s in decode_ok for x in s.itls]
    out_tokens = (sum(s.num_output_tokens for s in decode_ok)
                  + sum(r.sample.num_output_tokens for r in long_ok))
    row: dict[str, float] = {
        "wall_seconds": phase.wall, "output_tokens_per_s": out_tokens / phase.wall,
        "decode_requests": len(phase.decode), "long_requests": len(phase.long),
        "errors": (len(phase.decode) - len(decode_ok)) + (len(phase.long) - len(long_ok)),
        "decode_itl_p50": pct(itl, 50), "decode_itl_p99": pct(itl, 99),
        "decode_longest_stall": max(itl, default=float("nan")),
        "decode_ttft_p50": pct([s.ttft for s in decode_ok], 50),
        "decode_ttft_p95": pct([s.ttft for s in decode_ok], 95)}
    if long_ok:
        row.update({
            "long_ttft_p50": pct([r.ttft for r in long_ok], 50),
            "long_ttft_p95": pct([r.ttft for r in long_ok], 95),
            "long_prompt_tokens_mean": sum(r.prompt_tokens for r in long_ok) / len(long_ok)})
        remote = [r for r in long_ok if r.prefill_call_seconds]
        if remote:
            row["long_producer_prefill_seconds_mean"] = (
                sum(r.producer_prefill_seconds for r in remote) / len(remote))
    return row


def transfer_counters(base_url: str) -> dict[str, float]:
    """The consumer's received-side transfer counters (blocks, bytes, seconds, count) and its
    fallbacks, summed over reasons."""
    out = {"blocks": 0.0, "bytes": 0.0, "seconds": 0.0, "transfers": 0.0, "fallbacks": 0.0}
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvasir:kv_transfer_fallbacks_total":
                out["fallbacks"] += s.value
            if s.labels.get("direction") != "received":
                continue
            key = {"kvasir:kv_transfer_blocks_total": "blocks",
                   "kvasir:kv_transfer_bytes_total": "bytes",
                   "kvasir:kv_transfer_seconds_sum": "seconds",
                   "kvasir:kv_transfer_seconds_count": "transfers"}.get(s.name)
            if key:
                out[key] += s.value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


async def probe(setup: Setup, job: Job, tokens: int) -> dict[str, float]:
    """One long prompt alone: the producer's prefill time against the transfer's."""
    consumer = setup.urls["consumer"]
    before = transfer_counters(consumer)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        params, wall, prefill = await remote_prefill(client, setup.urls["producer"], job)
        sample = await one_request(client, consumer, None, job.prompt, 8, None,
                                   {"kv_transfer_params": params} if params else None)
    moved = delta(transfer_counters(consumer), before)
    return {"prompt_tokens": tokens, "producer_call_seconds": wall,
            "producer_prefill_seconds": prefill, "transfer_seconds": moved["seconds"],
            "transfer_bytes": moved["bytes"], "transfer_blocks": moved["blocks"],
            "consumer_ttft_seconds": sample.ttft, "fallbacks": moved["fallbacks"],
            "transfer_share_of_prefill": moved["seconds"] / prefill if prefill else float("nan")}


def start_setup(setup: Setup, out: Path) -> dict[str, object]:
    procs = {}
    for role, cmd in setup.commands.items():
        procs[role] = start(cmd, out / f"{setup.name}-{role}.log")
    for role, proc in procs.items():
        wait_ready(setup.urls[role], proc)
    if "gateway" in setup.urls:
        models = httpx.get(f"{setup.urls['consumer']}/v1/models", timeout=30).json()["data"]
        setup.model = models[0]["id"]
        wait_routable(setup.urls["gateway"], setup.model)
    return procs


def wait_routable(url: str, model: str, timeout: float = 120.0) -> None:
    """Until the gateway's probes have found a replica for `model` (its /ready says ready
    before its first probe round)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": model, "prompt": "warm up", "max_tokens": 1})
        if resp.status_code == 200:
            time.sleep(3.0)  # a probe round or two more: every replica's role known
            return
        time.sleep(1.0)
    raise RuntimeError(f"{url} routes no {model} request after {timeout}s")


def measure(setup: Setup, a: argparse.Namespace, workloads: dict[str, object]) -> dict:
    result: dict[str, object] = {"commands": setup.commands}
    for phase_name in ("quiet", "arrivals"):
        procs = start_setup(setup, a.out)  # a fresh server per phase: no cache carried over
        try:
            before = transfer_counters(setup.urls["consumer"]) if "consumer" in setup.urls else {}
            long_jobs = workloads["long"] if phase_name == "arrivals" else []
            phase = asyncio.run(run_phase(setup, workloads["decode"], long_jobs,  # type: ignore[arg-type]
                                          a.decode_streams, a.duration, a.route == "client"))
            row = summarize(phase)
            if before:
                moved = delta(transfer_counters(setup.urls["consumer"]), before)
                row["transfers"] = moved["transfers"]
                row["fallbacks"] = moved["fallbacks"]
                if moved["transfers"]:
                    row["bytes_per_transfer"] = moved["bytes"] / moved["transfers"]
                    row["seconds_per_transfer"] = moved["seconds"] / moved["transfers"]
            if phase_name == "arrivals" and "producer" in setup.urls:
                result["probe"] = asyncio.run(probe(setup, *workloads["probe"]))  # type: ignore[misc]
        finally:
            for proc in procs.values():
                stop(proc)
        result[phase_name] = row
        print(f"{setup.name:14s} {phase_name:8s} " + " ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True)
    return result


def long_arrivals(seed: int, duration: float, interval: float, prompt_tokens: tuple[int, int],
                  output_tokens: tuple[int, int]) -> list[tuple[float, Job, int]]:
    rng = random.Random(seed)
    times, at = [], rng.expovariate(1.0 / interval)
    while at < duration:
        times.append(at)
        at += rng.expovariate(1.0 / interval)
    jobs = make_workload(seed + 7, len(times), prompt_tokens, output_tokens)
    count = token_counter()
    return [(at, job, count(job.prompt)) for at, job in zip(times, jobs, strict=True)]


def ratios(rounds: list[dict]) -> list[dict[str, float]]:
    out = []
    for r in rounds:
        co, dis = r["colocated"], r["disaggregated"]
        row = {
            "disagg_itl_p99_arrivals_over_quiet":
                dis["arrivals"]["decode_itl_p99"] / dis["quiet"]["decode_itl_p99"],
            "colocated_itl_p99_arrivals_over_quiet":
                co["arrivals"]["decode_itl_p99"] / co["quiet"]["decode_itl_p99"],
            "disagg_over_colocated_output_tok_s":
                dis["arrivals"]["output_tokens_per_s"] / co["arrivals"]["output_tokens_per_s"],
            "disagg_over_colocated_long_ttft_p95":
                dis["arrivals"].get("long_ttft_p95", float("nan"))
                / co["arrivals"].get("long_ttft_p95", float("nan"))}
        if "probe" in dis:
            row["probe_transfer_share_of_prefill"] = dis["probe"]["transfer_share_of_prefill"]
        out.append(row)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    metrics = (("decode_itl_p99", "decode ITL p99 (ms)", 1000.0),
               ("decode_longest_stall", "longest decode stall (ms)", 1000.0),
               ("output_tokens_per_s", "output tokens/s", 1.0))
    labels = []
    values: dict[str, list[float]] = {m: [] for m, _, _ in metrics}
    for index, r in enumerate(result["rounds"]):
        for name in ("colocated", "disaggregated"):
            for phase in ("quiet", "arrivals"):
                labels.append(f"{name[:5]}\n{phase}\nr{index + 1}")
                for m, _, scale in metrics:
                    values[m].append(r[name][phase][m] * scale)
    for ax, (m, title, _) in zip(axes, metrics, strict=True):
        colors = ["tab:blue" if "coloc" in label else "tab:orange" for label in labels]
        ax.bar(range(len(labels)), values[m], color=colors)
        ax.set_xticks(range(len(labels)), labels, fontsize=6)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(host_line(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    p.add_argument("--cores", default="0,1", help="the first for the producer, the rest for the "
                   "consumer; all for the colocated engine")
    p.add_argument("--route", choices=("client", "gateway"), default="client",
                   help="who sends vLLM's two requests: this client, or kvasir-gateway")
    p.add_argument("--decode-streams", type=int, default=16)
    p.add_argument("--decode-prompt-tokens", default="64,256")
    p.add_argument("--decode-output-tokens", default="128,256")
    p.add_argument("--long-prompt-tokens", default="2000,6000")
    p.add_argument("--long-output-tokens", default="64,256")
    p.add_argument("--long-interval", type=float, default=12.0,
                   help="mean seconds between long prompts (Poisson)")
    p.add_argument("--probe-tokens", type=int, default=4000)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--engine-args", default="", help="more flags for every engine")
    p.add_argument("--gateway-args", default="", help="more flags for the gateway (--route "
                   "gateway), e.g. --disaggregation-min-prompt-tokens 1000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/disaggregation"))
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cores = [int(c) for c in a.cores.split(",")]
    if len(cores) < 2:
        raise SystemExit("--cores wants at least two cores: one producer, one consumer")
    a.out.mkdir(parents=True, exist_ok=True)
    decode_count = max(64, int(a.decode_streams * a.duration))  # more than a phase can use
    workloads: dict[str, object] = {
        "decode": make_workload(a.seed, decode_count, pair(a.decode_prompt_tokens,
                                "--decode-prompt-tokens"),
                                pair(a.decode_output_tokens, "--decode-output-tokens")),
        "long": long_arrivals(a.seed + 1, a.duration, a.long_interval,
                              pair(a.long_prompt_tokens, "--long-prompt-tokens"),
                              pair(a.long_output_tokens, "--long-output-tokens")),
        "probe": (make_workload(a.seed + 2, 1, (a.probe_tokens, a.probe_tokens), (8, 8))[0],
                  a.probe_tokens)}
    print(f"{len(workloads['long'])} long prompts per arrivals phase", flush=True)  # type: ignore[arg-type]
    rounds = []
    for index in range(a.rounds):
        order = setups(cores, a.max_model_len, a.route, a.engine_args, a.gateway_args)
        if index % 2:
            order.reverse()
        rounds.append({setup.name: measure(setup, a, workloads) for setup in order})
    result = {"command": " ".join(shlex.quote(x) for x in sys.argv), "host_cpu": host_line(),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              "rounds": rounds, "ratios": ratios(rounds)}
    for index, r in enumerate(result["ratios"]):
        print(f"round {index + 1}: " + ", ".join(f"{k}={v:.3f}" for k, v in r.items()))
    write_results(result, a.out / "disaggregation", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
