"""Native CPU quantized matmuls against float32 (MKL) and torch's own int8 ops: validate, then time.

Each product first runs once against its pure-torch twin (kernels/reference.py) and must match;
then every kernel is timed on weights cycled through a set larger than the L3 cache, so each
call reads its weights from memory as a decode step does. Writes JSON and a PNG of GFLOP/s
against the number of rows M (1 = single-stream decode, 16 = a batch, 512 = a prefill chunk).
On a host with AVX-512 VNNI the int8 weights are packed for it (`native_int8`, what a model
uses there) and the rows layout is timed beside it (`native_int8_rows`, the AVX2 kernels).

    .venv/bin/python bench/cpu_kernels.py --rows 1 16 512 --out bench/results/cpu_kernels
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kvasir_engine.kernels import cpu
from kvasir_engine.kernels import reference as ref
from kvasir_engine.kernels.host import onednn_available
from kvasir_engine.layers.onednn import OneDnnWeight
from kvasir_engine.layers.quantization import quantize_int4, quantize_int8
from results import write_results


def timed(fn: Callable[[int], object], copies: int, iterations: int) -> float:
    """Seconds per call of fn(i) for i cycling over the weight copies (after a warm-up)."""
    for i in range(3):
        fn(i % copies)
    start = time.perf_counter()
    for i in range(iterations):
        fn(i % copies)
    return (time.perf_counter() - start) / iterations


def measure(x: torch.Tensor, floats: list[torch.Tensor], int8: list, int8_rows: list,
            int4: list, cols: list[torch.Tensor], bf16: list, iterations: int,
            with_torch_int8: bool) -> dict[str, float]:
    """Seconds per call of each product of x [M, K] with the weight copies."""
    k, copies = x.shape[1], len(floats)
    xb = x.bfloat16()
    seconds = {
        "float32": timed(lambda i: torch.nn.functional.linear(x, floats[i]), copies, iterations),
        "native_int8": timed(lambda i: cpu.int8_linear(x, int8[i].rows, int8[i].scale, k),
                             copies, iterations),
        **({"bfloat16_onednn": timed(lambda i: bf16[i].matmul(xb), copies, iterations)}
           if bf16 else {}),
        **({"native_int8_rows": timed(lambda i: cpu.int8_linear(x, int8_rows[i], int8[i].scale, k),
                                      copies, iterations)}
           if int8[0].rows.dim() == 3 else {}),  # packed: time the rows layout beside it
        "native_int4": timed(lambda i: cpu.int4_linear(x, int4[i].packed, int4[i].scale,
                                                       int4[i].minimum, k),
                             copies, iterations),
    }
    if with_torch_int8:  # the fallback path: W8A16 up to 4 rows, W8A8 above (as layers do)
        xq = torch.round(x * 127 / x.abs().amax()).to(torch.int8)
        scale = int8[0].scale
        rows = [w[:, :k].contiguous() for w in int8_rows]
        if x.shape[0] <= 4:
            product: Callable[[int], object] = lambda i: torch._weight_int8pack_mm(x, rows[i], scale)  # noqa: E731
        else:
            product = lambda i: torch._int_mm(xq, cols[i])  # noqa: E731
        seconds["torch_int8"] = timed(product, copies, max(3, iterations // 20))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--n", type=int, default=3072, help="output features (SmolLM2 gate_up)")
    parser.add_argument("--k", type=int, default=576, help="input features")
    parser.add_argument("--weights-mb", type=int, default=256,
                        help="float32 megabytes of weight copies cycled through (beyond L3)")
    parser.add_argument("--torch-int8", action=argparse.BooleanOptionalAction, default=True,
                        help="also time torch._weight_int8pack_mm / torch._int_mm")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_kernels"))
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit("native CPU kernels unavailable on this machine (see the log above)")
    n, k = args.n, args.k
    copies = max(2, args.weights_mb * (1 << 20) // (n * k * 4))
    g = torch.Generator().manual_seed(0)
    floats = [torch.randn(n, k, generator=g) for _ in range(copies)]
    int8 = [quantize_int8(w, native=True) for w in floats]
    int4 = [quantize_int4(w, native=True) for w in floats]
    int8_rows = [cpu.int8_rows(w.rows, n) for w in int8]  # [N, Kp] whatever the layout
    # The default configuration's product where the host has it (bfloat16, packed for oneDNN).
    bf16 = [OneDnnWeight.pack(w.bfloat16()) for w in floats] if onednn_available() else []
    cols = [w[:, :k].t().contiguous() for w in int8_rows]
    rows_out = []
    for m in args.rows:
        x = torch.randn(m, k, generator=g)
        # Validate before timing: the kernels against their twins on the first copy.
        torch.testing.assert_close(cpu.int8_linear(x, int8[0].rows, int8[0].scale, k),
                                   ref.int8_linear(x, int8_rows[0], int8[0].scale, k),
                                   atol=1e-3, rtol=1e-4)
        q4 = int4[0]
        torch.testing.assert_close(cpu.int4_linear(x, q4.packed, q4.scale, q4.minimum, k),
                                   ref.int4_linear(x, q4.packed, q4.scale, q4.minimum, k),
                                   atol=1e-3, rtol=1e-4)
        iterations = 200 if m <= 16 else 20
        seconds = measure(x, floats, int8, int8_rows, int4, cols, bf16, iterations,
                          args.torch_int8)
        row = {"rows": m, "seconds": seconds,
               "gflops": {name: 2 * m * n * k / s / 1e9 for name, s in seconds.items()}}
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    result = {"n": n, "k": k, "threads": torch.get_num_threads(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows_out}
    write_results(result, args.out, plot)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["rows"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in result["rows"][0]["gflops"]:
        ax.plot(xs, [r["gflops"][name] for r in result["rows"]], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows M")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"[M, {result['k']}] x [{result['k']}, {result['n']}], "
                 f"{result['threads']} threads, {result['cpu_capability']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
