"""Quality of pre-quantized checkpoints on the default model (SmolLM2-135M), not a timing bench.

The default Q4_1 GGUF is exported to a bfloat16 Hugging Face checkpoint (transformers reads the
GGUF; its state dict goes into a fresh model, as docs/quantization.md says), which is then
quantized by compressed-tensors itself in each scheme (tests/engine/ct_checkpoints.py:
round-to-nearest scales from each weight's min / max; no GPTQ, no calibration). For each scheme,
and for our own `--quantization int8 / int4` of the same bfloat16 export, over one paragraph of
text (teacher forcing, every position):

- `kl_to_float32`: mean KL(float32 || ours), nats a token, against the bfloat16 export run by
  our engine in float32: what the scheme plus our kernels lose;
- `kl_reference_to_float32`: the same for the library's own dequantized model (transformers,
  float32): what the scheme alone loses;
- `argmax_agreement` with float32, and `kl_to_reference`: KL(reference || ours);
- `greedy_equal`: of a few prompts, how many greedy continuations (`--max-tokens` tokens) of
  ours equal the library reference's.

`--checkpoint NAME=DIR` adds a checkpoint of the same model quantized elsewhere (llm-compressor's
GPTQ: bench/gptq_checkpoint.py, which writes one from the bfloat16 export this script makes).

    .venv/bin/python bench/quality.py --out bench/results/quality [--checkpoint gptq-w4a16=DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from results import write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the test helpers that write checkpoints

from ct_checkpoints import (  # noqa: E402
    DEFAULT_MODEL_PROMPTS,
    export_default_bf16,
    quantize_export,
    reference_greedy,
    reference_model,
)
from helpers import PARAGRAPH as TEXT  # noqa: E402
from helpers import prefill_logits  # noqa: E402
from kvasir_engine.args import add_engine_args, engine_config_from_args  # noqa: E402
from kvasir_engine.core.request import SamplingParams  # noqa: E402
from kvasir_engine.frontend.llm_engine import LLMEngine  # noqa: E402
from kvasir_engine.worker.model_runner import ModelRunner  # noqa: E402

SCHEMES = ["w4a16", "w4a16_g64", "w4a16_asym", "w4a16_channel", "w8a16", "w8a8", "fp8"]


def engine_args(model: Path, *flags: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(
        [str(model), "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
         "--kv-cache-memory", str(64 << 20), *flags]))


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean KL(p || q) over positions, nats."""
    return float(torch.nn.functional.kl_div(q_logits.double().log_softmax(-1),
                                            p_logits.double().log_softmax(-1), log_target=True,
                                            reduction="batchmean"))


def greedy(config, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outputs = LLMEngine.from_config(config).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quality")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="a pre-quantized checkpoint of the same model made elsewhere "
                             "(bench/gptq_checkpoint.py), measured like the schemes")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvasir-quality-"))
    started = time.time()
    bf16 = export_default_bf16(work / "bf16")
    tokenizer = LLMEngine.from_config(engine_args(bf16)).tokenizer
    token_ids = tokenizer.encode(TEXT)
    prompts = [tokenizer.encode(p) for p in DEFAULT_MODEL_PROMPTS]
    float32 = prefill_logits(ModelRunner(engine_args(bf16)), token_ids)
    rows: dict[str, dict[str, object]] = {}

    def ours(name: str, model: Path, *flags: str, reference=None) -> None:  # type: ignore[no-untyped-def]
        config = engine_args(model, *flags)
        runner = ModelRunner(config)
        logits = prefill_logits(runner, token_ids)
        runs_as = config.model.quantization or (
            f"{config.model.dtype} (dequantized at load)"
            if config.model.checkpoint_quantization else config.model.dtype)
        row: dict[str, object] = {
            "runs_as": f"{runs_as} weights, float activations" if runner.kernels.weight_only
            else runs_as,
            "kl_to_float32": kl(float32, logits),
            "argmax_agreement": float((logits.argmax(-1) == float32.argmax(-1)).float().mean()),
        }
        if reference is not None:
            with torch.inference_mode():
                ref_logits = reference(torch.tensor([token_ids])).logits[0].float()
            row["kl_reference_to_float32"] = kl(float32, ref_logits)
            row["kl_to_reference"] = kl(ref_logits, logits)
            mine = greedy(config, prompts, args.max_tokens)
            theirs = [reference_greedy(reference, p, args.max_tokens) for p in prompts]
            same = sum(a == b for a, b in zip(mine, theirs, strict=True))
            row["greedy_equal"] = f"{same}/{len(prompts)}"
        rows[name] = row
        print(name, row, flush=True)

    ours("bf16 export, bfloat16 compute", bf16, "--dtype", "bfloat16")
    ours("ours int8 (--quantization)", bf16, "--quantization", "int8")
    ours("ours int4 (--quantization)", bf16, "--quantization", "int4")
    for scheme in args.schemes.split(","):
        directory = quantize_export(bf16, work / scheme, scheme)
        ours(f"compressed-tensors {scheme}", directory, reference=reference_model(directory))
    for item in args.checkpoint:
        name, _, path = item.partition("=")
        ours(name, Path(path), reference=reference_model(Path(path)))
    result = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF exported to bfloat16)",
              "text_tokens": len(token_ids), "greedy_prompts": len(prompts),
              "greedy_tokens": args.max_tokens, "compute_dtype": "float32",
              "seconds": round(time.time() - started, 1), "rows": rows}
    write_results(result, args.out, plot)


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["rows"])
    values = [result["rows"][n]["kl_to_float32"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(names) + 1.2))
    ax.barh(names, values)
    ax.invert_yaxis()
    ax.set_xlabel("mean KL to float32 (nats/token)")
    ax.set_title(result["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    main()
