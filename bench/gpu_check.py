"""GPU check: kernel tests compiled for real, decode-attention bandwidth, model throughput. JSON out.

Validate, then benchmark (llm.c's habit): first the kernel-vs-twin tests run on the GPU (the
wide grids included), then
- decode attention of a Llama-3-8B layer (32 query / 8 KV heads, head_dim 128, bfloat16) at
  several batch x context shapes; bytes moved = every cached K and V byte once
  (2 * sum(seq_lens) * 8 * 128 * 2), against the GPU's peak HBM bandwidth and a measured
  device-to-device copy;
- decode and prefill throughput of a Llama-3-8B-shaped model with random weights at batch
  1/16/64, decode both eager and with CUDA graphs.
Without CUDA it says what it skipped and exits 0; `--smoke-cpu` runs the model benchmark code on
a tiny model on CPU (torch attention, eager) so the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Peak HBM bandwidth in GB/s by device-name substring (vendor datasheets).
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
             "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "A10": 600,
             "RTX 4090": 1008, "RTX 3090": 936, "V100": 900, "T4": 320}


def timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median seconds of one call, after two warm-up calls."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(2):
        fn()
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def run_kernel_tests(timeout_s: int) -> dict[str, object]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", str(ROOT / "tests/engine/kernels")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    return {"returncode": proc.returncode, "summary": tail, **counts}


def peak_bandwidth_gbps(name: str) -> float | None:
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return float(gbps)
    return None


def copy_bandwidth_gbps(device: torch.device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 10, device)
    return 2 * src.numel() / seconds / 1e9  # read + write


def decode_attention_bandwidth(device: torch.device) -> list[dict[str, object]]:
    from kvasir_engine.kernels.paged_attention import paged_decode_attention

    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    results = []
    for batch, seq_len in ((1, 32768), (16, 4096), (64, 2048), (64, 8192)):
        blocks = batch * seq_len // block_size
        k_cache = torch.randn(blocks, block_size, num_kv_heads, head_dim, device=device,
                              dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(blocks, device=device, dtype=torch.int64).to(torch.int32)
        tables = tables.view(batch, seq_len // block_size)
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        query = torch.randn(batch, num_heads, head_dim, device=device, dtype=torch.bfloat16)
        seconds = timed(partial(paged_decode_attention, query, k_cache, v_cache, tables, lens,
                                head_dim**-0.5, max_seq_len=seq_len), 20, device)
        moved = 2 * batch * seq_len * num_kv_heads * head_dim * 2
        results.append({"batch": batch, "seq_len": seq_len, "us": seconds * 1e6,
                        "gbps": moved / seconds / 1e9})
    return results


def llama3_8b_arch(tiny: bool):  # type: ignore[no-untyped-def]
    from kvasir_engine.checkpoint.arch import ModelArch, RopeScaling

    if tiny:
        return ModelArch("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 2048)
    return ModelArch("LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                     intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                     rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
                     torch_dtype="bfloat16")


def build_model(arch, backend_name: str, device: torch.device, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    from kvasir_engine.kernels.choice import KernelChoice
    from kvasir_engine.models.registry import model_class

    # The runner's choice on CUDA: the Triton backend with its fused norm and rotary, or the
    # torch reference throughout.
    kernels = (KernelChoice(attention_backend="triton", decode_attention="triton",
                            norm="triton", rotary="triton")
               if backend_name == "triton" else KernelChoice())
    old_device, old_dtype = torch.get_default_device(), torch.get_default_dtype()
    torch.set_default_device(device)  # parameters are born on the device, never on the host
    torch.set_default_dtype(dtype)
    try:
        model = model_class(arch.architecture)(arch, kernels, 0, 1, None)
    finally:
        torch.set_default_device(old_device)
        torch.set_default_dtype(old_dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
    return model.eval()


def decode_meta(batch: int, context: int, block_size: int, device: torch.device):  # type: ignore[no-untyped-def]
    """Every request at `context` tokens, decoding its last one; block 0 stays the null block."""
    from kvasir_engine.attention.metadata import AttentionMetadata

    per_req = -(-context // block_size)
    tables = 1 + torch.arange(batch * per_req, dtype=torch.int32, device=device).view(batch, -1)
    pos = context - 1
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return AttentionMetadata(slots, starts, lens, tables, 1, context, tuple(range(batch + 1)),
                             (context,) * batch, True)


def prefill_meta(batch: int, length: int, block_size: int, device: torch.device):  # type: ignore[no-untyped-def]
    from kvasir_engine.attention.metadata import AttentionMetadata

    per_req = -(-length // block_size)
    tables = 1 + torch.arange(batch * per_req, dtype=torch.int32, device=device).view(batch, -1)
    pos = torch.arange(length, device=device)
    slots = (tables[:, pos // block_size].long() * block_size + pos % block_size).flatten()
    lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    starts = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=device)
    return AttentionMetadata(slots, starts, lens, tables, length, length,
                             tuple(starts.tolist()), (length,) * batch, False)


def model_throughput(device: torch.device, tiny: bool) -> dict[str, object]:
    from kvasir_engine.worker.cuda_graphs import DecodeCUDAGraphs

    arch = llama3_8b_arch(tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "triton" if device.type == "cuda" else "torch"
    batches, context, prompt_len, block_size = (1, 16, 64), 1024, 512, 16
    if tiny:
        context, prompt_len = 64, 32
    model = build_model(arch, backend, device, dtype)
    num_blocks = 1 + max(batches) * -(-max(context, prompt_len) // block_size)
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    kv = [(torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype,
                                                                      device=device))
          for _ in range(arch.num_hidden_layers)]

    def forward(ids, pos, meta):  # type: ignore[no-untyped-def]
        return model(ids, pos, kv, meta)

    def logits(run, ids, pos, meta, rows=None):  # type: ignore[no-untyped-def]
        hidden = run(ids, pos, meta)
        return model.compute_logits(hidden if rows is None else hidden[rows])

    graphs = None
    if device.type == "cuda":
        graphs = DecodeCUDAGraphs(forward, max(batches), context, block_size, arch.hidden_size,
                                  dtype, device)
        start = time.perf_counter()
        graphs.capture()
        capture_s = time.perf_counter() - start
    result: dict[str, object] = {"model": "tiny" if tiny else "llama-3-8b-shaped",
                                 "num_params": arch.num_params, "dtype": str(dtype),
                                 "decode_context": context, "prefill_len": prompt_len}
    if graphs is not None:
        result["graph_capture_s"] = capture_s
    rows = []
    with torch.inference_mode():
        for batch in batches:
            meta = decode_meta(batch, context, block_size, device)
            ids = torch.randint(0, arch.vocab_size, (batch,), device=device)
            pos = torch.full((batch,), context - 1, device=device)
            row: dict[str, object] = {"batch": batch}
            eager = timed(partial(logits, forward, ids, pos, meta), 10, device)
            row["decode_eager_tok_s"] = batch / eager
            if graphs is not None:
                graph = timed(partial(logits, graphs.run, ids, pos, meta), 10, device)
                row["decode_graph_tok_s"] = batch / graph
                row["graph_speedup"] = eager / graph
            pmeta = prefill_meta(batch, prompt_len, block_size, device)
            pids = torch.randint(0, arch.vocab_size, (batch * prompt_len,), device=device)
            ppos = torch.arange(prompt_len, device=device).repeat(batch)
            last = pmeta.query_start_loc[1:].long() - 1
            prefill = timed(partial(logits, forward, pids, ppos, pmeta, last), 3, device)
            row["prefill_tok_s"] = batch * prompt_len / prefill
            rows.append(row)
    result["rows"] = rows
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/gpu_check.json")
    parser.add_argument("--skip-tests", action="store_true", help="skip the kernel test suite")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="without CUDA, run the model benchmark on a tiny model on CPU")
    args = parser.parse_args(argv)
    report: dict[str, object] = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU found: SKIPPED the kernel tests on GPU, the decode "
              "attention bandwidth and the Llama-3-8B throughput (nothing was measured)")
        report["skipped"] = ["kernel_tests", "attention_bandwidth", "model_throughput"]
        if args.smoke_cpu:
            report["smoke_cpu"] = model_throughput(torch.device("cpu"), tiny=True)
    else:
        device = torch.device("cuda", 0)
        name = torch.cuda.get_device_name(device)
        report["device"] = name
        if not args.skip_tests:
            report["kernel_tests"] = run_kernel_tests(timeout_s=240)
        peak = peak_bandwidth_gbps(name)
        copy = copy_bandwidth_gbps(device)
        rows = decode_attention_bandwidth(device)
        for row in rows:
            row["frac_of_peak"] = row["gbps"] / peak if peak else None  # type: ignore[operator]
            row["frac_of_copy"] = row["gbps"] / copy  # type: ignore[operator]
        report["attention"] = {"peak_gbps": peak, "copy_gbps": copy, "rows": rows}
        torch.cuda.empty_cache()
        report["model_throughput"] = model_throughput(device, tiny=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    failed = isinstance(report.get("kernel_tests"), dict) and report["kernel_tests"]["returncode"]  # type: ignore[index]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
