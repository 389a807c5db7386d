"""Write a GPTQ W4A16 checkpoint of a Hugging Face model with llm-compressor's one-shot, for
bench/quality.py (`--checkpoint gptq-w4a16=DIR`): what users download for vLLM, made on CPU.

llm-compressor is not in the venv: 0.14 pins transformers <= 5.17 and compressed-tensors 0.19
(the venv has 5.25 and 0.20.1). It runs from an overlay that leaves the venv alone:

    .venv/bin/pip install --no-deps --target /tmp/llmc llmcompressor==0.14.0.1 \\
        transformers==5.17.0 compressed-tensors==0.19.0 huggingface_hub==1.33.0 auto-round==0.15.1
    PYTHONPATH=/tmp/llmc .venv/bin/python bench/gptq_checkpoint.py BF16_DIR OUT_DIR

The calibration set is made here: 32 chunks of 256 tokens of this repository's docs/*.md
(English prose; no hub). Group size 64: SmolLM2's 576-wide layers rule out 128.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()

    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(args.model))
    ids = tokenizer("\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    ids = ids["input_ids"]
    chunks = [ids[i * args.tokens:(i + 1) * args.tokens] for i in range(args.samples)]
    dataset = Dataset.from_dict({"input_ids": chunks,
                                 "attention_mask": [[1] * len(c) for c in chunks]})
    model = transformers.AutoModelForCausalLM.from_pretrained(str(args.model),
                                                              dtype=torch.bfloat16)
    recipe = GPTQModifier(ignore=["lm_head"], config_groups={"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": args.group_size}}})
    started = time.time()
    oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=args.samples,
            max_seq_length=args.tokens)
    model.save_pretrained(str(args.out), save_compressed=True)
    tokenizer.save_pretrained(str(args.out))
    print(f"GPTQ W4A16 group {args.group_size}: {time.time() - started:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
