"""vLLM's side of bench/step_profile.py: the same closed-loop workload driven through vLLM's own
engine, in-process, one `step()` at a time, in vLLM's virtualenv (it imports nothing of Kvasir).

bench/step_profile.py `--vllm-dir DIR` runs this file with DIR's python
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so the model runs in this process and torch.profiler sees its
operators) and hands it the workload as JSON: prompts as text, generation lengths, the
concurrency, the step counts. Both engines go through the same loop (`drive`), which times each
step from the outside (`classify`): a step is *decode-only* when every request in flight at its
start already had its first token, and the prompt tokens of the requests whose first token a
step brought are charged to it. One line `PEER_STEPS_RESULT {json}` on stdout.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from collections.abc import Callable

MARK = "PEER_STEPS_RESULT "
# torch.profiler operator names -> a part of the step, for both engines (first match wins).
OP_CLASSES = (
    ("attention", ("attention", "attn", "scaled_dot_product", "softmax", "paged", "reshape_and_cache")),
    ("matmul", ("linear", "aten::mm", "addmm", "matmul", "mkldnn", "gemm", "onednn",
                "int8_linear", "int4_linear")),
    ("norm, rotary, activation", ("norm", "rotary", "rotary_embedding", "silu", "aten::mul",
                                  "aten::add", "aten::rsqrt", "aten::pow", "aten::mean")),
    ("sampler", ("topk", "aten::sort", "argmax", "multinomial", "log_softmax", "exponential")),
)


def op_classes(profiler, num_steps: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Self CPU time of the profiled steps by operator class, in ms per step."""
    totals: collections.Counter[str] = collections.Counter()
    for event in profiler.key_averages():
        name = event.key.lower()
        part = next((cls for cls, keys in OP_CLASSES if any(k in name for k in keys)), "other")
        totals[part] += event.self_cpu_time_total / 1000 / num_steps
    return dict(totals.most_common())


def classify(steps: list[dict[str, float]]) -> dict[str, float]:
    """Decode-only step (median of the steps with nothing to prefill, ms) and what a prompt
    token adds (the other steps' time above that median, summed, over their prompt tokens)."""
    decode = [s["seconds"] for s in steps if s["prompt_tokens"] == 0 and s["waiting"] == 0]
    base = statistics.median(decode) if decode else 0.0
    others = [s for s in steps if s["prompt_tokens"] > 0 or s["waiting"] > 0]
    tokens = sum(s["prompt_tokens"] for s in others)
    excess = sum(s["seconds"] - base for s in others)
    return {"decode_only_steps": len(decode), "decode_only_step_ms": base * 1e3,
            "per_prompt_token_ms": excess / tokens * 1e3 if tokens else 0.0,
            "step_ms_p50": statistics.median(s["seconds"] for s in steps) * 1e3,
            "output_tokens_per_s": sum(s["output_tokens"] for s in steps)
            / sum(s["seconds"] for s in steps)}


def drive(add: Callable[[str, dict], None], step: Callable[[], list[tuple[str, int, bool]]],
          work: dict, profile: bool) -> dict:
    """Closed loop over `work` (jobs, concurrency, warmup_steps, steps, profile_steps): `add(id,
    job)` queues a request, `step()` runs one engine step and returns (id, the tokens it added,
    finished) per request it advanced. Both engines are driven by this same loop."""
    jobs = iter(enumerate(work["jobs"]))
    in_flight: dict[str, int] = {}  # id -> prompt tokens, until its first token
    started: set[str] = set()
    total = work["warmup_steps"] + work["steps"]
    window = (work["warmup_steps"], work["warmup_steps"] + work["profile_steps"])
    records: list[dict[str, float]] = []
    profiler, ops = None, {}
    for index in range(total):
        while len(in_flight) + len(started) < work["concurrency"]:
            i, job = next(jobs)
            add(f"r{i}", job)
            in_flight[f"r{i}"] = job["prompt_tokens"]
        waiting = len(in_flight)
        if profile and index == window[0]:
            import torch

            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.start()
        start = time.perf_counter()
        outputs = step()
        seconds = time.perf_counter() - start
        prompt_tokens = outputs_tokens = 0
        for req_id, new_tokens, finished in outputs:
            if req_id in in_flight:
                prompt_tokens += in_flight.pop(req_id)
                started.add(req_id)
            outputs_tokens += new_tokens
            if finished:
                started.discard(req_id)
        if profiler is not None and index + 1 == window[1]:
            profiler.stop()
            ops = op_classes(profiler, window[1] - window[0])
            profiler = None
        if index >= work["warmup_steps"] and not window[0] <= index < window[1]:
            records.append({"seconds": seconds, "prompt_tokens": prompt_tokens,
                            "waiting": waiting, "output_tokens": outputs_tokens})
    return {**classify(records), "ops_ms_per_step": ops}


def vllm(work: dict, model: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", max_model_len=work["max_model_len"],
              max_num_seqs=work["concurrency"], enable_prefix_caching=False)
    engine = llm.llm_engine

    def add(req_id: str, job: dict) -> None:
        engine.add_request(req_id, job["prompt"], SamplingParams(
            max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True))

    so_far: dict[str, int] = {}  # its outputs are cumulative: the tokens each step added

    def step() -> list[tuple[str, int, bool]]:
        added = []
        for out in engine.step():
            total = len(out.outputs[0].token_ids)
            added.append((out.request_id, total - so_far.get(out.request_id, 0), out.finished))
            so_far[out.request_id] = total
        return added

    return drive(add, step, work, profile=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="the workload, JSON (step_profile.py)")
    parser.add_argument("--vllm-model", required=True)
    args = parser.parse_args()
    with open(args.input) as file:
        work = json.load(file)
    result = vllm(work, args.vllm_model)
    print(MARK + json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
