"""Offline decode throughput of the engine against `transformers.generate`, same run, same dtype.

By default a second engine with `--quantization int8` (int8 weights, see
kvasir_engine/layers/quantization.py) runs the same workload too, reported as `engine_int8`
next to the --dtype engine; transformers always runs in --dtype.

Workload per concurrency level c: c prompts of seeded random token ids (lengths 32..256, so no
two share a prefix), each generating exactly --max-tokens tokens (ignore_eos). The engine takes
them all at once (continuous batching); transformers gets the same batch left-padded (static
batching). Reports output tokens/s for both, the ratio, the per-step time against the weight-read
roofline, and KV memory waste (allocated block slots vs tokens stored, sampled every step).

    .venv/bin/python bench/offline_throughput.py --dtype bfloat16 --concurrency 1 8 32 64
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.checkpoint.format import CheckpointFormat, checkpoint_format
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from results import write_results


def make_prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab_size) for _ in range(rng.randint(32, 256))]
            for _ in range(count)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    block_size = engine.runtime.block_size
    for index, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{index}", prompt, params)
    waste_slots = alloc_slots = steps = 0
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        generated += sum(len(out.new_token_ids) for out in outputs)
        stats = engine.last_stats
        allocated = stats.num_kv_blocks_in_use * block_size
        alloc_slots += allocated
        waste_slots += allocated - stats.num_kv_tokens_stored
    seconds = time.perf_counter() - start
    assert generated == len(prompts) * max_tokens, (generated, len(prompts) * max_tokens)
    return {"seconds": seconds, "output_tokens": generated, "tokens_per_s": generated / seconds,
            "steps": steps, "ms_per_step": 1000 * seconds / steps,
            "kv_waste_frac": waste_slots / alloc_slots if alloc_slots else 0.0,
            "block_size": block_size}


def run_transformers(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> dict[str, float]:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
    seconds = time.perf_counter() - start
    generated = (out.shape[1] - width) * len(prompts)
    return {"seconds": seconds, "output_tokens": generated, "tokens_per_s": generated / seconds}


def load_transformers(model_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if checkpoint_format(path) is CheckpointFormat.GGUF_FILE:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--also-int8", action=argparse.BooleanOptionalAction, default=True,
                        help="also run a second engine with --quantization int8 (CPU)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/offline_throughput"))
    args = parser.parse_args()
    if args.dtype == "auto":
        args.dtype = "bfloat16"
    config = engine_config_from_args(args)
    engine = LLMEngine.from_config(config)
    int8_engine = None
    if args.also_int8 and config.model.quantization is None and config.device.device == "cpu":
        int8_engine = LLMEngine.from_config(
            replace(config, model=replace(config.model, quantization="int8")))
    dtype = getattr(torch, config.model.dtype)
    hf_model = None if args.skip_transformers else load_transformers(config.model.model, dtype)
    pad_id = min(engine.runtime.eos_token_ids) if engine.runtime.eos_token_ids else 0
    vocab = config.model.arch.vocab_size
    # Warm both paths so one-off costs (allocation, oneDNN kernel selection) are not measured.
    run_engine(engine, make_prompts(2, vocab, seed=99), 8)
    if int8_engine is not None:
        run_engine(int8_engine, make_prompts(2, vocab, seed=99), 8)
    if hf_model is not None:
        run_transformers(hf_model, make_prompts(2, vocab, seed=99), 8, pad_id)
    rows = []
    for concurrency in args.concurrency:
        prompts = make_prompts(concurrency, vocab, seed=concurrency)
        row = {"concurrency": concurrency, "engine": run_engine(engine, prompts, args.max_tokens)}
        if int8_engine is not None:
            row["engine_int8"] = run_engine(int8_engine, prompts, args.max_tokens)
        if hf_model is not None:
            row["transformers"] = run_transformers(hf_model, prompts, args.max_tokens, pad_id)
            for key, speedup in (("engine", "speedup"), ("engine_int8", "speedup_int8")):
                if key in row:
                    row[speedup] = row[key]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    engine.shutdown()
    if int8_engine is not None:
        int8_engine.shutdown()
    # Roofline: one decode step must read every weight once (bytes / measured bandwidth).
    weight_bytes = config.model.arch.num_params * dtype.itemsize
    result = {"model": config.model.model, "dtype": config.model.dtype,
              "quantization": config.model.quantization,
              "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
              "weight_bytes": weight_bytes,
              "roofline_ms_per_step_at_22GBps": 1000 * weight_bytes / 22e9, "rows": rows}
    write_results(result, args.out, plot)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["engine"]["tokens_per_s"] for r in rows], "o-",
            label=f"kvasir engine ({result['quantization'] or result['dtype']})")
    if all("engine_int8" in r for r in rows):
        ax.plot(xs, [r["engine_int8"]["tokens_per_s"] for r in rows], "^-",
                label="kvasir engine (--quantization int8)")
    if all("transformers" in r for r in rows):
        ax.plot(xs, [r["transformers"]["tokens_per_s"] for r in rows], "s--",
                label="transformers generate (static batch)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Offline throughput, {Path(result['model']).name}, {result['dtype']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
