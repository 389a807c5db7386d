"""Decode step time of the engine on CPU: the fused native decode forward against the eager
layers, same engine, same run, per quantization and batch size.

For each --quantization method and each concurrency C: one engine, C prompts of --prompt-len
seeded random token ids prefilled, then --steps decode steps timed with the fused path
(models/fused_decode.py) and as many with it switched off, alternating in blocks of 10 so a
drift of the (shared, noisy) host hits both alike. Reports median ms per step and the
eager / fused ratio; writes JSON and a PNG.

    .venv/bin/python bench/decode_step.py --quantization-methods int8 int4 --concurrency 1 16 \
        --kv-cache-dtype bfloat16 --dtype float32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from results import write_results


def measure(engine: LLMEngine, concurrency: int, prompt_len: int, steps: int) -> dict[str, float]:
    model = engine.core.executor.runner.model.model  # type: ignore[attr-defined]
    fused = model.fused_decode
    rng = random.Random(concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 20, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"c{concurrency}-{i}",
                           [rng.randrange(1000, 40000) for _ in range(prompt_len)], params)
    while engine.last_stats.num_running_reqs < concurrency or any(
            r.num_output_tokens == 0 for r in engine.core.scheduler.running):
        engine.step()
    times: dict[str, list[float]] = {"fused": [], "eager": []}
    for block in range(2 * steps // 10):
        name = "fused" if block % 2 == 0 else "eager"
        model.fused_decode = fused if name == "fused" else None
        for _ in range(10):
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
    model.fused_decode = fused
    engine.abort_request([f"c{concurrency}-{i}" for i in range(concurrency)])
    engine.step()
    fused_ms = 1000 * statistics.median(times["fused"])
    eager_ms = 1000 * statistics.median(times["eager"])
    return {"fused_ms": fused_ms, "eager_ms": eager_ms, "eager_over_fused": eager_ms / fused_ms}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['quantization']} C={r['concurrency']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([x - 0.2 for x in xs], [r["eager_ms"] for r in rows], 0.4, label="eager layers")
    ax.bar([x + 0.2 for x in xs], [r["fused_ms"] for r in rows], 0.4, label="fused decode")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("CPU decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--quantization-methods", nargs="+", default=["int8", "int4"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per path")
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode_step"))
    args = parser.parse_args()
    base = engine_config_from_args(args)
    rows = []
    for method in args.quantization_methods:
        engine = LLMEngine.from_config(replace(base, model=replace(base.model,
                                                                   quantization=method)))
        for concurrency in args.concurrency:
            row = {"quantization": method, "concurrency": concurrency,
                   **measure(engine, concurrency, args.prompt_len, args.steps)}
            print(row, flush=True)
            rows.append(row)
        engine.shutdown()
    result = {"model": base.model.model, "dtype": base.model.dtype,
              "kv_cache_dtype": base.cache.resolved_kv_cache_dtype(base.model.dtype),
              "prompt_len": args.prompt_len, "rows": rows}
    write_results(result, args.out, plot)


if __name__ == "__main__":
    main()
