"""Speculative decoding (n-gram prompt lookup) against plain decoding, same engine, same run.

Workloads, greedy, `--max-tokens` each (ignore_eos):
- repetitive: the model is asked to copy a passage it was given (code and prose), so the
  continuation repeats its context: n-gram lookup proposes well;
- free: open-ended prompts, whose continuations rarely repeat the prompt.

At each concurrency C (1 and 16 by default) the same C prompts run with and without
`--speculative-config` (ngram, k = --num-speculative-tokens, the engine's default automatic
turn-off). Reports output tokens/s, mean inter-token latency (per request, first to last token,
averaged) and the acceptance rate (accepted / draft tokens verified), and checks that the
speculative run's tokens equal the plain run's.

    .venv/bin/python bench/speculative.py --out bench/results/speculative
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvasir_engine.args import add_engine_args, engine_config_from_args
from kvasir_engine.core.request import SamplingParams
from kvasir_engine.frontend.llm_engine import LLMEngine
from results import write_results

ROOT = Path(__file__).resolve().parents[1]

PASSAGES = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n    return a / b\n",
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the key value cache "
    "in fixed size blocks, and continuous batching schedules decodes and prefill chunks "
    "together in every step of the engine.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n"
    "        print(i, 'odd')\n",
    "Kubernetes runs containers in pods. A Deployment keeps a number of pods running, a "
    "Service gives them one address, and a PodDisruptionBudget bounds voluntary evictions.",
]
TOPICS = ["a lighthouse keeper", "the history of bread", "a robot learning to paint",
          "why the sky is blue", "a journey across a desert", "the rules of chess",
          "a city under the sea", "the life of a honeybee"]


def prompts_for(engine: LLMEngine, workload: str, count: int) -> list[list[int]]:
    texts = []
    for i in range(count):
        if workload == "repetitive":
            passage = PASSAGES[i % len(PASSAGES)]
            content = f"Repeat the following text exactly, twice:\n\n{passage}"
        else:
            content = f"Write a short story about {TOPICS[i % len(TOPICS)]}."
        texts.append(content)
    return [engine.tokenizer.encode(
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n") for text in texts]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, object]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    drafts = accepted = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        drafts += engine.last_stats.num_spec_draft_tokens
        accepted += engine.last_stats.num_spec_accepted_tokens
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                tokens[out.request_id] += out.new_token_ids
    seconds = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    itl = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1]
    return {"tokens_per_s": generated / seconds, "seconds": seconds, "steps": steps,
            "itl_ms": 1000 * sum(itl) / len(itl), "draft_tokens": drafts, "accepted": accepted,
            "acceptance_rate": accepted / drafts if drafts else None,
            "tokens": [tokens[r] for r in ids]}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    labels = [f"{c['workload']}\nC={c['concurrency']}" for c in cases]
    speedups = [c["speedup"] for c in cases]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, speedups, color=["tab:green" if s >= 1 else "tab:red"
                                           for s in speedups])
    for bar, case in zip(bars, cases, strict=True):
        rate = case["spec"]["acceptance_rate"]
        ax.annotate(f"{case['speedup']:.2f}x\nacc {rate:.0%}" if rate is not None
                    else f"{case['speedup']:.2f}x\n(off)",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("tokens/s, speculative / plain")
    ax.set_title(f"n-gram speculative decoding, k={result['num_speculative_tokens']} "
                 f"({result['model_name']})")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--workloads", nargs="+", default=["repetitive", "free"])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speculative")
    ns = parser.parse_args()
    plain_config = engine_config_from_args(ns)
    ns.speculative_config = json.dumps({"method": "ngram", "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 2,
                                        "num_speculative_tokens": ns.num_speculative_tokens})
    spec_config = engine_config_from_args(ns)
    plain_engine, spec_engine = LLMEngine.from_config(plain_config), LLMEngine.from_config(
        spec_config)
    cases = []
    for workload in ns.workloads:
        for concurrency in ns.concurrency:
            prompts = prompts_for(plain_engine, workload, concurrency)
            run(plain_engine, prompts[:1], 4)  # warm-up
            run(spec_engine, prompts[:1], 4)
            plain = run(plain_engine, prompts, ns.max_tokens)
            spec = run(spec_engine, prompts, ns.max_tokens)
            same = plain.pop("tokens") == spec.pop("tokens")
            case = {"workload": workload, "concurrency": concurrency, "plain": plain,
                    "spec": spec, "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                    "identical_tokens": same}
            print(json.dumps(case))
            cases.append(case)
    result = {"model_name": plain_config.model.served_model_name,
              "dtype": plain_config.model.dtype, "max_tokens": ns.max_tokens,
              "num_speculative_tokens": ns.num_speculative_tokens,
              "disable_by_batch_size": spec_config.speculative.disable_by_batch_size
              if spec_config.speculative else None, "cases": cases}
    write_results(result, ns.out, plot)


if __name__ == "__main__":
    main()
