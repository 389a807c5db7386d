"""Pipeline parallelism on CPU processes: throughput and inter-token latency of PP=2 against PP=1,
with the bubble and the bytes handed between stages measured by the ranks themselves.

Each configuration runs the same workload through `LLMEngine` (the scheduler, the executor, the
rank processes; no HTTP): --concurrency prompts of seeded random token ids (--prompt-len each,
no shared prefix), each generating exactly --max-tokens tokens (ignore_eos), all admitted at
once. Configurations: PP=1 (one process, every core), PP=2 with one micro-batch per step (the
default), PP=2 with two. Each rank of PP=2 gets half the cores, so on one host PP can only lose:
what it buys is fitting a model that one node's memory cannot hold, and what this measures is
what that costs.

Reported per configuration: output tokens/s, mean inter-token latency (the gaps between a
request's consecutive tokens), and for PP=2 each stage's bubble (the share of its step time
spent waiting on the other stage: receiving, sending, the sampled tokens coming back) and the
bytes stage 0 sent per token (hidden state + residual: 2 x hidden x dtype bytes). Napkin maths
for a balanced pipeline of P stages and M micro-batches within one step: the bubble is
(P - 1) / (M + P - 1), 50% at M=1 and 33% at M=2 for P=2.

    flock /tmp/kvasir-cpu.lock .venv/bin/python bench/pipeline.py --out bench/results/pipeline
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.config import EngineConfig
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from results import write_results

CONFIGS = [("PP=1", 1, None), ("PP=2, 1 micro-batch", 2, 1), ("PP=2, 2 micro-batches", 2, 2)]


def run(config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    engine = LLMEngine.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        engine.generate([prompts[0][:8]], replace(params, max_tokens=4))  # warm-up
        stamps: dict[str, list[float]] = {}
        for index, prompt in enumerate(prompts):
            engine.add_request(f"bench-{index}", prompt, params)
            stamps[f"bench-{index}"] = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                stamps[out.request_id] += [time.perf_counter()] * len(out.new_token_ids)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    gaps = [b - a for times in stamps.values() for a, b in zip(times, times[1:], strict=False)]
    generated = sum(len(times) for times in stamps.values())
    assert generated == len(prompts) * max_tokens, generated
    result: dict[str, Any] = {
        "seconds": seconds, "output_tokens": generated, "tokens_per_s": generated / seconds,
        "mean_itl_ms": 1000 * sum(gaps) / len(gaps), "dtype": config.model.dtype}
    stats = getattr(engine.core.executor, "pipeline_stats", [])
    if stats and config.parallel.pipeline_parallel_size > 1:
        result["stages"] = [{"rank": s.rank, "pp_rank": s.pp_rank, "steps": s.num_steps,
                             "bubble": s.bubble, "step_s": s.step_s, "wait_s": s.wait_s,
                             "sent_bytes": s.sent_bytes, "sent_tokens": s.num_sent_tokens}
                            for s in stats]
        first = next(s for s in stats if s.pp_rank == 0)
        result["bytes_per_token"] = first.sent_bytes / max(1, first.num_sent_tokens)
        result["bubble"] = sum(s.bubble for s in stats) / len(stats)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed-prompts", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/pipeline"))
    args = parser.parse_args()
    base = engine_config_from_args(args)
    rng = random.Random(args.seed_prompts)
    vocab = base.model.arch.vocab_size
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.concurrency)]
    rows = []
    for name, pp, micro in CONFIGS:
        config = replace(base, parallel=replace(base.parallel, pipeline_parallel_size=pp,
                                                pipeline_micro_batches=micro))
        row = {"name": name, "pp": pp, "micro_batches": micro or 1,
               **run(config, prompts, args.max_tokens)}
        print(f"{name}: {row['tokens_per_s']:.1f} tok/s, ITL {row['mean_itl_ms']:.1f} ms"
              + (f", bubble {row['bubble']:.0%}, {row['bytes_per_token']:.0f} B/token"
                 if "bubble" in row else ""), flush=True)
        rows.append(row)
    result = {"model": base.model.model, "concurrency": args.concurrency,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "host": _host(), "rows": rows}
    write_results(result, args.out, plot)


def _host() -> dict[str, Any]:
    import os

    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown")
    flags = [f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in info]
    return {"cpu": name, "cores": len(os.sched_getaffinity(0)), "flags": flags}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["name"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    left.bar(names, [r["tokens_per_s"] for r in rows], color=["#4c72b0", "#dd8452", "#55a868"])
    left.set_ylabel("output tokens/s")
    right.bar(names, [r["mean_itl_ms"] for r in rows], color=["#4c72b0", "#dd8452", "#55a868"])
    right.set_ylabel("mean inter-token latency (ms)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    for r, x in zip(rows, range(len(rows)), strict=True):
        if "bubble" in r:
            left.annotate(f"bubble {r['bubble']:.0%}\n{r['bytes_per_token']:.0f} B/token",
                          (x, r["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{Path(result['model']).name}: {result['concurrency']} requests x "
                 f"{result['max_tokens']} tokens, {result['host']['cores']} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
