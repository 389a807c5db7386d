"""Where a light tenant's first token waits under a flood, step by step (offline, no HTTP).

bench/fairness.py measures the light tenant's TTFT at the client; this drives the same load
in-process (a light tenant at `--light-rate` requests/s and a heavy one at `--ratio` times it,
seeded Poisson arrivals, prompts of `--prompt-tokens` random tokens, `--max-tokens` generated,
`ignore_eos`) through `LLMEngine` in real time, and records every step's plan (decode rows,
each request's prefill tokens, by tenant) and duration. It reports:

- the step kinds and their durations: `decode` (decode rows only), `mixed` (decodes and prefill
  chunks), `alone` (a first token's prefill alone, fair_share.py's "first token alone"),
  `interjected` (a first token run between two layers of the step in flight, scheduler.py's
  "Interjection"; that step's own time includes it);
- the light tenant's TTFT (arrival -> first token, engine time only), and the residual of the
  step each light request arrived into (what no admission rule can shorten);
- the slowest light requests with the steps they waited through, e.g. `M25/H45 A22/L41
  M*28/L58`: arrived during a 25 ms mixed step with a heavy 45-token prefill, then another
  light request's prefill alone, then its own prefill (`*`) in a 28 ms mixed step.

    .venv/bin/python bench/fairness_steps.py --out bench/results/fairness_steps \\
        --quantization int8 --kv-cache-dtype bfloat16   # any engine flag; 16 running by default

Writes JSON and a PNG (step duration against prefill tokens, by kind; light TTFT by arrival).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fairness import arrival_times
from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from results import write_results
from serving import pct


def step_kind(num_decodes: int, prefill: dict[str, int]) -> str:
    return "decode" if not prefill else "alone" if num_decodes == 0 else "mixed"


def drive(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.load_seed)
    low, high = (int(x) for x in args.prompt_tokens.split(","))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(rng.randint(low, high))]

    arrivals = sorted(
        [(t, "light") for t in arrival_times(random.Random(args.load_seed * 2 + 1),
                                             args.light_rate, args.duration)]
        + [(t, "heavy") for t in arrival_times(random.Random(args.load_seed * 2 + 2),
                                               args.light_rate * args.ratio, args.duration)])
    for i in range(args.max_num_seqs):  # warm-up: every shape once
        engine.add_request(f"warm-{i}", prompt(), params, tenant_id="heavy")
    while engine.has_unfinished_requests():
        engine.step()
    scheduler = engine.core.scheduler
    plans = []
    schedule = scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        plan = schedule()
        plans.append(plan)
        return plan

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    steps: list[dict[str, Any]] = []
    light: dict[str, list[float]] = {}  # request id -> [arrival, first token] (s from start)
    num_tokens_in_window, next_arrival = 0, 0
    t0 = time.monotonic()

    def admit_due() -> int:
        """Add the requests whose arrival time has come; how many."""
        nonlocal next_arrival
        now, first = time.monotonic() - t0, next_arrival
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
            at, tenant = arrivals[next_arrival]
            request_id = f"{tenant}-{next_arrival}"
            engine.add_request(request_id, prompt(), params, tenant_id=tenant,
                               arrival_time=t0 + at)
            if tenant == "light":
                light[request_id] = [at]
            next_arrival += 1
        return next_arrival - first

    def record(outputs: list[Any], plan: Any, started: float, ended: float) -> None:
        nonlocal num_tokens_in_window
        prefill = {rid: n for rid, n in plan.num_scheduled_tokens.items() if n > 1}
        num_decodes = len(plan.num_scheduled_tokens) - len(prefill)
        steps.append({"start": started - t0, "seconds": ended - started,
                      "num_decodes": num_decodes, "prefill": prefill,
                      "kind": "interjected" if plan is not plans[-1]
                      else step_kind(num_decodes, prefill)})
        for out in outputs:
            if ended - t0 <= args.duration:
                num_tokens_in_window += len(out.new_token_ids)
            times = light.get(out.request_id)
            if times is not None and len(times) == 1 and out.new_token_ids:
                times.append(ended - t0)

    cut_plans = []
    schedule_interjection = scheduler.schedule_interjection

    def recording_interjection():  # type: ignore[no-untyped-def]
        plan = schedule_interjection()
        if plan is not None:
            cut_plans.append(plan)
        return plan

    scheduler.schedule_interjection = recording_interjection  # type: ignore[method-assign]

    def between_layers() -> None:  # what the server's engine thread does (engine_thread.py)
        if admit_due():
            started = time.monotonic()
            while (outputs := engine.interject()) is not None:
                ended = time.monotonic()
                record(outputs, cut_plans[-1], started, ended)
                started = ended

    while next_arrival < len(arrivals) or engine.has_unfinished_requests():
        admit_due()
        if not engine.has_unfinished_requests():
            time.sleep(0.0005)
            continue
        started = time.monotonic()
        step = engine.begin_step()  # a layer at a time, as EngineThread._step runs it
        while step.advance():
            between_layers()
        outputs = engine.end_step(step)
        record(outputs, plans[-1], started, time.monotonic())
    return {"steps": steps, "light": light,
            "output_tokens_per_s": num_tokens_in_window / args.duration}


def label(step: dict[str, Any], request_id: str) -> str:
    """`M25/H45+L41`: kind, ms, each prefill by tenant initial; `*` when it is request_id's."""
    mark = "*" if request_id in step["prefill"] else ""
    chunks = "+".join(f"{rid[0].upper()}{n}" for rid, n in step["prefill"].items())
    return f"{step['kind'][0].upper()}{mark}{step['seconds'] * 1e3:.0f}" + (f"/{chunks}"
                                                                              if chunks else "")


def summarize(run: dict[str, Any], num_slowest: int) -> dict[str, Any]:
    steps = run["steps"]
    total = sum(s["seconds"] for s in steps if s["kind"] != "interjected")  # inside a step
    kinds = {}
    for kind in ("decode", "mixed", "alone", "interjected"):
        durations = [s["seconds"] for s in steps if s["kind"] == kind]
        if durations:
            kinds[kind] = {"steps": len(durations), "time_share": sum(durations) / total,
                           "ms_p50": pct(durations, 50) * 1e3, "ms_p95": pct(durations, 95) * 1e3,
                           "prefill_tokens_mean": statistics.fmean(
                               sum(s["prefill"].values()) for s in steps if s["kind"] == kind)}
    waits, residuals = [], []
    for request_id, times in run["light"].items():
        if len(times) < 2:
            continue
        at, first = times
        through = sorted((s for s in steps if s["start"] + s["seconds"] > at
                          and s["start"] < first), key=lambda s: s["start"])
        own = [s for s in through if request_id in s["prefill"]]
        if own and own[0]["kind"] == "interjected":  # it waited only for the next layer
            residuals.append(own[0]["start"] - at)
            through = [s for s in through if s["kind"] == "interjected"]
        else:
            residuals.append(through[0]["start"] + through[0]["seconds"] - at
                             if through and through[0]["start"] <= at else 0.0)
        waits.append((first - at, " ".join(label(s, request_id) for s in through)))
    ttfts = [w for w, _ in waits]
    waits.sort(key=lambda w: -w[0])
    return {"output_tokens_per_s": run["output_tokens_per_s"], "steps_by_kind": kinds,
            "light_requests": len(ttfts), "light_ttft_ms_p50": pct(ttfts, 50) * 1e3,
            "light_ttft_ms_p95": pct(ttfts, 95) * 1e3,
            "residual_ms_p50": pct(residuals, 50) * 1e3,
            "residual_ms_p95": pct(residuals, 95) * 1e3,
            "slowest_light": [f"{w * 1e3:.1f} ms: {path}" for w, path in waits[:num_slowest]]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for kind in ("decode", "mixed", "alone", "interjected"):
        steps = [s for s in result["steps"] if s["kind"] == kind]
        ax1.scatter([sum(s["prefill"].values()) for s in steps],
                    [s["seconds"] * 1e3 for s in steps], s=5, label=kind)
    ax1.set(xlabel="prefill tokens in the step", ylabel="step ms", title="steps under the flood")
    light = [t for t in result["light"].values() if len(t) == 2]
    ax2.scatter([t[0] for t in light], [(t[1] - t[0]) * 1e3 for t in light], s=8)
    ax2.set(xlabel="arrival (s)", ylabel="TTFT ms (engine)", title="light tenant's first tokens")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{result['host_cpu']} | {result['command']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--light-rate", type=float, default=3.0, help="light requests/s")
    parser.add_argument("--ratio", type=float, default=10.0, help="heavy rate / light rate")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--prompt-tokens", default="34,60", help="min,max prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--load-seed", type=int, default=1, help="arrivals and prompts")
    parser.add_argument("--slowest", type=int, default=10, help="light requests to trace")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fairness_steps"))
    args = parser.parse_args()
    if args.max_model_len is None:
        args.max_model_len = 2048
    if args.max_num_seqs is None:  # bench/fairness.py's server
        args.max_num_seqs = 16
    engine = LLMEngine.from_config(engine_config_from_args(args))
    try:
        run = drive(engine, args)
    finally:
        engine.shutdown()
    summary = summarize(run, args.slowest)
    for key, value in summary.items():
        if key != "slowest_light":
            print(f"{key}: {value}")
    print("slowest light requests (the steps they waited through):")
    for line in summary["slowest_light"]:
        print("  " + line)
    result = {"command": " ".join(sys.argv), **summary, **run}
    write_results(result, args.out, plot)


if __name__ == "__main__":
    main()
