"""lm-evaluation-harness against a real Kvasir server on 127.0.0.1 (issue 14, defect 5).

`lm_eval --model local-completions` runs three local tasks shipped in lm_eval_tasks/ (JSONL data,
no hub): a multiple-choice task and a perplexity task, scored by loglikelihood requests (`echo` +
`logprobs` + `max_tokens` 1, what failed before), and a generation task (`generate_until`). The
loglikelihoods lm-eval computes from the server's answers must equal the model's own scores,
computed offline with transformers on the same checkpoint; the accuracy it reports must equal
the offline argmax choice; the generations must equal transformers' greedy ones.

The checkpoint is a tiny random Llama with large initial weights, so its distributions are peaked
(the top two tokens at least 0.04 nats apart on these texts) and greedy choices are not ties.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import API_KEY, LiveServer, live_server, tiny_config
from helpers import write_checkpoint

pytest.importorskip("lm_eval")

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TOL = 1e-3  # nats, on a sum of a few float32 logprobs
MAX_GEN_TOKS = 8  # as kvasir_gen.yaml says
TASKS = ("kvasir_mc", "kvasir_ppl", "kvasir_gen")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("peaked-llama"), "llama", seed=1,
                            initializer_range=0.5)


@pytest.fixture(scope="module")
def lm_eval_server(checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(tiny_config(checkpoint)) as live:
        yield live


@pytest.fixture(scope="module")
def lm_eval_run(lm_eval_server: LiveServer, checkpoint: Path,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs the lm_eval CLI once; returns its results and per-task samples."""
    out_dir = tmp_path_factory.mktemp("lm-eval-out")
    model_args = ",".join([
        "model=test", f"base_url={lm_eval_server.base_url}/v1/completions",
        f"tokenizer={checkpoint}", "tokenizer_backend=huggingface", "tokenized_requests=True",
        "max_length=256", "num_concurrent=1", "max_retries=1", "timeout=60"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(out_dir / "hf-home"),
           "OPENAI_API_KEY": API_KEY, "TOKENIZERS_PARALLELISM": "false"}
    command = [str(Path(sys.executable).parent / "lm_eval"), "run",
               "--model", "local-completions", "--model_args", model_args,
               "--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR),
               "--output_path", str(out_dir / "results"), "--log_samples", "--seed", "0",
               "--batch_size", "4"]
    # The tasks name their JSONL relative to their own directory.
    done = subprocess.run(command, cwd=TASKS_DIR, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = [json.loads(p.read_text()) for p in (out_dir / "results").rglob("results_*.json")]
    assert len(results) == 1, list((out_dir / "results").rglob("*"))
    samples = {task: [json.loads(line) for p in (out_dir / "results").rglob(f"samples_{task}_*")
                      for line in p.read_text().splitlines()]
               for task in TASKS}
    return {"results": results[0]["results"], "samples": samples}


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> tuple[Any, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint),
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(checkpoint))


def _docs(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (TASKS_DIR / name).read_text().splitlines()]


def offline_loglikelihood(reference: tuple[Any, Any], context: str, continuation: str) -> float:
    """The continuation's log-likelihood, split into tokens as lm-eval splits it."""
    model, tokenizer = reference
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    num_context = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(num_context, len(whole)))


def test_multiple_choice_loglikelihoods_equal_the_offline_scores(
        lm_eval_run: dict[str, Any], reference: tuple[Any, Any]) -> None:
    docs = _docs("kvasir_mc.jsonl")
    samples = sorted(lm_eval_run["samples"]["kvasir_mc"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(docs)))
    num_correct = 0
    for doc, sample in zip(docs, samples, strict=True):
        offline = [offline_loglikelihood(reference, doc["question"], " " + choice)
                   for choice in doc["choices"]]
        served = [float(resp[0][0]) for resp in sample["resps"]]  # [[loglikelihood, greedy]]
        assert served == pytest.approx(offline, abs=TOL), doc["question"]
        best = max(range(len(offline)), key=offline.__getitem__)
        margin = sorted(offline)[-1] - sorted(offline)[-2]
        assert margin > 10 * TOL, "the offline argmax must not be a near tie"
        assert sample["acc"] == float(best == doc["answer"])
        num_correct += best == doc["answer"]
    accuracy = lm_eval_run["results"]["kvasir_mc"]["acc,none"]
    assert math.isclose(accuracy, num_correct / len(docs))


def test_perplexity_loglikelihoods_equal_the_offline_scores(
        lm_eval_run: dict[str, Any], reference: tuple[Any, Any]) -> None:
    model, tokenizer = reference
    docs = _docs("kvasir_ppl.jsonl")
    samples = sorted(lm_eval_run["samples"]["kvasir_ppl"], key=lambda s: s["doc_id"])
    total_loglikelihood, total_bytes = 0.0, 0
    for doc, sample in zip(docs, samples, strict=True):
        # One rolling window per document (each is far below max_length): EOS, then the text.
        ids = [tokenizer.eos_token_id] + tokenizer(doc["text"], add_special_tokens=False).input_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        offline = sum(logprobs[i - 1, ids[i]].item() for i in range(1, len(ids)))
        assert float(sample["resps"][0][0]) == pytest.approx(offline, abs=TOL), doc["text"]
        total_loglikelihood += offline
        total_bytes += len(doc["text"].encode())
    bits_per_byte = lm_eval_run["results"]["kvasir_ppl"]["bits_per_byte,none"]
    assert bits_per_byte == pytest.approx(-total_loglikelihood / total_bytes / math.log(2),
                                          rel=1e-5)


def test_generations_equal_the_offline_greedy_ones(lm_eval_run: dict[str, Any],
                                                   reference: tuple[Any, Any]) -> None:
    model, tokenizer = reference
    docs = _docs("kvasir_gen.jsonl")
    samples = sorted(lm_eval_run["samples"]["kvasir_gen"], key=lambda s: s["doc_id"])
    num_exact = 0
    for doc, sample in zip(docs, samples, strict=True):
        ids = tokenizer(doc["prompt"], add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_GEN_TOKS,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == text, doc["prompt"]
        num_exact += text == doc["target"]
    exact = lm_eval_run["results"]["kvasir_gen"]["exact_match,none"]
    assert math.isclose(exact, num_exact / len(docs))
