"""Serving benchmark: a closed-loop load generator against any OpenAI-compatible endpoint.

For each concurrency level, C clients send streaming `/v1/completions` requests back to back from a
fixed, seeded workload (distinct prompts at every level, so no server's prompt cache flatters it)
and we record time to first token, inter-token latency (gaps between streamed tokens), end-to-end
latency, output tokens/s, requests/s and errors. Given TTFT and ITL p95 objectives it reports the
highest concurrency meeting both: the number an interactive service is sized on.

Where the server reports its own timings (Kvasir's `kvasir` block in the closing chunk), it also
records the engine's view: TTFT as queue + prefill time, ITL as decode time per token after the
first. The gap to the client's figures is what the HTTP path (asyncio, SSE, sockets) adds.

It can start the servers itself and compare them in one run, e.g.:

    python bench/serving.py --concurrency 1,4,16 --max-tokens 64 \
        --server "kvasir=.venv/bin/kvasir-engine serve --port 8100" --port kvasir=8100 \
        --server "llama=.tools/llama-server -m MODEL --no-repack --port 8200 -np 16 -c 32768" \
        --port llama=8200 --out bench/results/serving

or measure running endpoints with `--url NAME=http://host:port`. Writes NAME.json per run plus a
PNG of throughput and p95 latency against concurrency (the hockey stick).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = ("model cache block token batch queue engine server paged kernel stream request latency "
         "prefill decode schedule memory tensor weight layer head vector score river mountain "
         "garden music window planet winter summer yellow silver market history science").split()


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str = ""
    # From the server's own timings, when it reports them (seconds).
    engine_ttft: float | None = None
    engine_itl: float | None = None


def make_prompts(seed: int, count: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {seed}-{i}: " + " ".join(rng.choice(WORDS)
                                              for _ in range(rng.randint(min_words, max_words)))
            for i in range(count)]


async def one_request(client: httpx.AsyncClient, url: str, model: str | None, prompt: str,
                      max_tokens: int, sample: Sample | None = None) -> Sample:
    """`sample`, when given, is filled in as the stream goes (a caller that cancels reads it)."""
    body: dict[str, object] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                               "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    last = start
    sample = Sample(ok=False) if sample is None else sample
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                sample.error = f"HTTP {resp.status_code}"
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload.get("usage"):
                    sample.num_output_tokens = payload["usage"]["completion_tokens"]
                    _read_engine_timings(sample, payload.get("kvasir"))
                if not any(c.get("text") for c in payload.get("choices") or []):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    sample.ttft = now - start
                else:
                    sample.itls.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        sample.error = type(e).__name__
        return sample
    sample.e2e = time.perf_counter() - start
    sample.num_output_tokens = sample.num_output_tokens or chunks
    sample.ok = chunks > 0
    return sample


def _read_engine_timings(sample: Sample, timings: dict[str, float] | None) -> None:
    if not timings:
        return
    sample.engine_ttft = timings["queue_seconds"] + timings["prefill_seconds"]
    if sample.num_output_tokens > 1:
        sample.engine_itl = timings["decode_seconds"] / (sample.num_output_tokens - 1)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def run_level(url: str, model: str | None, prompts: list[str], concurrency: int,
                    max_tokens: int) -> dict[str, float]:
    queue = list(reversed(prompts))
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one_request(client, url, model, "warm up", 4)

        async def worker() -> None:
            while queue:
                samples.append(await one_request(client, url, model, queue.pop(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    good = [s for s in samples if s.ok]
    ttft, e2e = [s.ttft for s in good], [s.e2e for s in good]
    itl = [x for s in good for x in s.itls]
    out: dict[str, float] = {"concurrency": concurrency, "requests": len(samples),
                             "errors": len(samples) - len(good), "wall_seconds": wall,
                             "output_tokens_per_s": sum(s.num_output_tokens for s in good) / wall,
                             "requests_per_s": len(good) / wall}
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 95, 99):
            out[f"{name}_p{q}"] = pct(values, q)
    out["itl_mean"] = statistics.fmean(itl) if itl else float("nan")
    engine_ttft = [s.engine_ttft for s in good if s.engine_ttft is not None]
    engine_itl = [s.engine_itl for s in good if s.engine_itl is not None]
    if engine_ttft and engine_itl:
        out["engine_ttft_p50"] = pct(engine_ttft, 50)
        out["engine_itl_p50"] = pct(engine_itl, 50)
    errors = sorted({s.error or "empty stream" for s in samples if not s.ok})
    return {**out, "error_kinds": errors} if errors else out


def _engine_view(row: dict[str, float]) -> str:
    if "engine_itl_p50" not in row:
        return ""
    return (f" | engine TTFT p50={row['engine_ttft_p50']:.3f}s "
            f"ITL p50={row['engine_itl_p50'] * 1000:.1f}ms")


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        for path in ("/ready", "/health"):
            try:
                if httpx.get(url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def start(cmd: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(shlex.split(cmd), stdout=log.open("wb"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def slo_concurrency(levels: list[dict[str, float]], ttft_slo: float, itl_slo: float) -> int | None:
    meeting = [int(r["concurrency"]) for r in levels  # type: ignore[call-overload]
               if r["errors"] == 0 and r["ttft_p95"] <= ttft_slo and r["itl_p95"] <= itl_slo]
    return max(meeting) if meeting else None


def plot(results: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, levels in results.items():
        cs = [r["concurrency"] for r in levels]
        ax1.plot(cs, [r["output_tokens_per_s"] for r in levels], marker="o", label=name)
        ax2.plot(cs, [r["ttft_p95"] for r in levels], marker="o", label=f"{name} TTFT p95")
        ax2.plot(cs, [r["itl_p95"] for r in levels], marker="x", ls="--", label=f"{name} ITL p95")
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", title="throughput")
    ax2.set(xlabel="concurrency", ylabel="seconds", xscale="log", yscale="log",
            title="p95 latency")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_named(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{flag} wants NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", default=[], help="NAME=http://host:port (running)")
    p.add_argument("--server", action="append", default=[], help="NAME=command to start it")
    p.add_argument("--port", action="append", default=[], help="NAME=port of a --server")
    p.add_argument("--model", action="append", default=[], help="NAME=model field to send")
    p.add_argument("--restart-between-levels", action="store_true")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--requests-per-level", type=int, default=0, help="default: max(8, 3 x C)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", default="40,160", help="min,max words per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT p95 objective, seconds")
    p.add_argument("--itl-slo", type=float, default=0.1, help="ITL p95 objective, seconds")
    p.add_argument("--out", type=Path, default=Path("bench/results/serving"))
    a = p.parse_args(argv)
    urls, cmds = parse_named(a.url, "--url"), parse_named(a.server, "--server")
    ports, models = parse_named(a.port, "--port"), parse_named(a.model, "--model")
    for name in cmds:
        if name not in ports:
            raise SystemExit(f"--server {name} needs --port {name}=PORT")
        urls[name] = f"http://127.0.0.1:{ports[name]}"
    levels = [int(c) for c in a.concurrency.split(",")]
    lo, hi = (int(w) for w in a.prompt_words.split(","))
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {}
    for name, url in urls.items():
        proc = start(cmds[name], a.out / f"{name}.log") if name in cmds else None
        try:
            wait_ready(url, proc)
            results[name] = []
            for index, c in enumerate(levels):
                if proc is not None and a.restart_between_levels and index:
                    stop(proc)
                    proc = start(cmds[name], a.out / f"{name}.log")
                    wait_ready(url, proc)
                n = a.requests_per_level or max(8, 3 * c)
                prompts = make_prompts(a.seed * 1000 + index, n, lo, hi)
                row = asyncio.run(run_level(url, models.get(name), prompts, c, a.max_tokens))
                results[name].append(row)
                print(f"{name:8s} C={c:3d} out_tok/s={row['output_tokens_per_s']:8.1f} "
                      f"req/s={row['requests_per_s']:6.2f} TTFT p50/p95={row['ttft_p50']:.3f}/"
                      f"{row['ttft_p95']:.3f}s ITL p50/p95={row['itl_p50'] * 1000:.1f}/"
                      f"{row['itl_p95'] * 1000:.1f}ms errors={int(row['errors'])}"
                      + _engine_view(row), flush=True)
        finally:
            if proc is not None:
                stop(proc)
    slo = {name: slo_concurrency(rows, a.ttft_slo, a.itl_slo) for name, rows in results.items()}
    report = {"command": " ".join(shlex.quote(x) for x in sys.argv), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "slo": {"ttft_p95_seconds": a.ttft_slo, "itl_p95_seconds": a.itl_slo,
                "max_concurrency": slo}, "results": results}
    (a.out / "serving.json").write_text(json.dumps(report, indent=2))
    plot(results, a.out / "serving.png")
    for name, c in slo.items():
        print(f"{name}: highest concurrency meeting TTFT p95 <= {a.ttft_slo}s and ITL p95 <= "
              f"{a.itl_slo}s: {c}")
    print(f"wrote {a.out / 'serving.json'} and {a.out / 'serving.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
