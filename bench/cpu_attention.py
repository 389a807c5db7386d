"""CPU attention of the torch backend: decode steps and prefills of the default model's shapes.

Validate, then benchmark (llm.c's habit). Decode: C concurrent requests with contexts like
bench/offline_throughput.py (a 32..256-token prompt plus 10..60 generated tokens), block ids
handed out as the block pool does (a prompt's blocks in a row, decode blocks interleaved), every
layer its own cache, metadata built by the runner's `prepare_batch`; each timed round advances
every context by one token, so plans and matmul shapes change as in serving. Every backend is
first checked against the float32 twin of the kernels (kernels/reference.py). Prefill: one
request of Q new tokens on an empty cache. The numbers are ms per step (all layers) and per
prefill (one layer).

With one thread the clock is the thread's CPU time, so other load on the machine does not count;
with more it is wall time. `--compare OTHER.py` loads another copy of torch_backend.py and times
both interleaved (A/B, B/A, ... medians), the only fair comparison on a shared machine.

    .venv/bin/python bench/cpu_attention.py --threads 1 --compare /tmp/torch_backend_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from kvasir_engine.attention import torch_backend
from kvasir_engine.attention.backend import AttentionBackend
from kvasir_engine.attention.metadata import AttentionMetadata
from kvasir_engine.core.outputs import CachedRequestData, SchedulerOutput
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.kernels import cpu
from kvasir_engine.kernels.reference import paged_prefill_attention
from kvasir_engine.worker.input_batch import RequestState, prepare_batch

# SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads of 64 dims; engine block size 16.
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
Clock = Callable[[], float]
ATOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 2e-5}


def pool_step(plan: list[tuple[int, int]], decoded: list[int],
              num_blocks: int) -> AttentionMetadata:
    """(cached, new) tokens per request, of which `decoded` were generated one per step ->
    the runner's metadata, with block ids handed out as the pool does: a prompt's in a row,
    decode blocks interleaved, block 0 kept as the null block."""
    prompt = [cached + new - generated
              for (cached, new), generated in zip(plan, decoded, strict=True)]
    starts = list(itertools.accumulate((-(-n // BLOCK_SIZE) for n in prompt), initial=1))
    tables = [list(range(starts[i], starts[i + 1])) for i in range(len(plan))]
    lens, next_block = list(prompt), starts[-1]
    for _ in range(max(decoded, default=0)):
        for i, generated in enumerate(decoded):
            if lens[i] < prompt[i] + generated:
                lens[i] += 1
                if len(tables[i]) * BLOCK_SIZE < lens[i]:
                    tables[i].append(next_block)
                    next_block += 1
    if next_block > num_blocks:
        raise ValueError(f"{next_block} blocks needed, {num_blocks} allocated")
    states = {str(i): RequestState(str(i), [0] * (cached + new), prompt[i], SamplingParams(),
                                   tables[i], cached)
              for i, (cached, new) in enumerate(plan)}
    scheduled = SchedulerOutput([], [CachedRequestData(r, [], s.num_computed_tokens)
                                     for r, s in states.items()],
                                {str(i): new for i, (_, new) in enumerate(plan)},
                                sum(new for _, new in plan))
    return prepare_batch(scheduled, states, BLOCK_SIZE, torch.device("cpu"), 1,
                         frozenset()).meta


def max_error(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata) -> float:
    """Against the float32 twin of the kernels (engine/kvasir_engine/kernels/reference.py)."""
    expected = paged_prefill_attention(query.float(), k_cache.float(), v_cache.float(),
                                       meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       HEAD_DIM ** -0.5)
    return float((out.float() - expected).abs().max())


def load_backend(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"backend_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def interleaved(fns: list[Callable[[int], object]], rounds: int, clock: Clock) -> list[float]:
    """Median ms of each fn(round), all called once per round, in an order reversed every other
    round so none always runs first (the first round is warm-up)."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds + 1):
        for i in range(len(fns)) if r % 2 else reversed(range(len(fns))):
            start = clock()
            fns[i](r)
            if r:
                times[i].append(1000 * (clock() - start))
    return [round(statistics.median(t), 3) for t in times]


def bench_decode(backends: list[AttentionBackend], concurrency: int, dtype: torch.dtype,
                 rounds: int, clock: Clock) -> list[float]:
    rng = random.Random(concurrency)
    decoded = [rng.randint(10, 60) for _ in range(concurrency)]
    plan = [(rng.randint(32, 256) + d - 1, 1) for d in decoded]
    grow = rounds + 1  # tokens each context gains while timed
    num_blocks = sum(-(-(c + n + grow) // BLOCK_SIZE) for c, n in plan) + len(plan) + 1
    gen = torch.Generator().manual_seed(concurrency)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(dtype)
    # Per layer: q, k, v of this step's tokens and the layer's K and V caches.
    layers = [(rand(concurrency, NUM_HEADS, HEAD_DIM), rand(concurrency, NUM_KV_HEADS, HEAD_DIM),
               rand(concurrency, NUM_KV_HEADS, HEAD_DIM), rand(*shape), rand(*shape))
              for _ in range(NUM_LAYERS)]
    meta = pool_step(plan, decoded, num_blocks)
    for backend in backends:
        q, k, v, k_cache, v_cache = layers[0]
        out = backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
        error = max_error(out, q, k_cache, v_cache, meta)
        if error > ATOL[dtype]:
            raise SystemExit(f"decode C={concurrency}: max error {error} > {ATOL[dtype]}")
    # Round r decodes one token more than round r - 1; the metadata is built before the clock
    # starts, one object per backend (a backend plans once per metadata object, as per step).
    metas = [[pool_step([(c + grown, n) for c, n in plan], [d + grown for d in decoded],
                        num_blocks) for _ in backends] for grown in range(grow)]

    def step(index: int, backend: AttentionBackend, round_index: int) -> None:
        meta = metas[round_index][index]
        for q, k, v, k_cache, v_cache in layers:
            backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    return interleaved([partial(step, i, b) for i, b in enumerate(backends)], rounds, clock)


def bench_prefill(backends: list[AttentionBackend], num_tokens: int, dtype: torch.dtype,
                  rounds: int, clock: Clock) -> list[float]:
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 1
    meta = pool_step([(0, num_tokens)], [0], num_blocks)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    q, k, v = (torch.randn(num_tokens, h, HEAD_DIM, generator=gen).to(dtype)
               for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    for backend in backends:
        out = backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
        error = max_error(out, q, k_cache, v_cache, meta)
        if error > ATOL[dtype]:
            raise SystemExit(f"prefill {num_tokens}: max error {error} > {ATOL[dtype]}")

    def prefill(backend: AttentionBackend, round_index: int) -> None:
        backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    return interleaved([partial(prefill, b) for b in backends], rounds, clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 32, 64])
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=[64, 256, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--compare", default=None, help="another torch_backend.py to time against")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_attention.json"))
    parser.add_argument("--native-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="this tree's decode rows through the native kernel (default: "
                             "where it builds, as the engine chooses)")
    args = parser.parse_args()
    native = cpu.available() if args.native_decode is None else args.native_decode
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    dtype = getattr(torch, args.dtype)
    modules = [torch_backend] + ([load_backend(args.compare)] if args.compare else [])
    backends = [torch_backend.TorchAttentionBackend(native_decode=native)] + [
        m.TorchAttentionBackend() for m in modules[1:]]
    names = ["torch_backend"] + ([args.compare] if args.compare else [])
    rows = []
    with torch.inference_mode():
        for concurrency in args.concurrency:
            ms = bench_decode(backends, concurrency, dtype,
                              args.rounds, clock)
            rows.append({"kind": "decode", "concurrency": concurrency,
                         "ms_per_step": dict(zip(names, ms, strict=True))})
            print(json.dumps(rows[-1]), flush=True)
        for num_tokens in args.prefill_tokens:
            ms = bench_prefill(backends, num_tokens, dtype,
                               max(3, args.rounds // 3), clock)
            rows.append({"kind": "prefill", "tokens": num_tokens,
                         "ms_per_layer": dict(zip(names, ms, strict=True))})
            print(json.dumps(rows[-1]), flush=True)
    result = {"dtype": args.dtype, "threads": args.threads, "layers": NUM_LAYERS,
              "heads": NUM_HEADS, "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
              "block_size": BLOCK_SIZE, "clock": clock.__name__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
