"""fp32 GEMM (MKL, F.linear) vs int8 activations x int8 weights (FBGEMM's dynamic int8 linear, torch.ao) on the
default model's projection shapes, side by side in one run: what int8 arithmetic would buy the compute-bound
batched decode and prefill (not wired into the engine; docs/PERFORMANCE.md, "Batching and paging").

    .venv/bin/python scripts/cpu_int8_gemm.py [--rows 16 256]

The weights stay in cache between repeats (a 7 MB matrix): this compares arithmetic, not memory traffic.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # SmolLM2-135M: qkv, o, gate_up, down


def best_time(fn, reps: int = 50, warmup: int = 1) -> float:
    """Seconds per call of fn: the best of 5 rounds of reps calls, after warmup calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256])
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, quantized engine {torch.backends.quantized.engine}")
    print(f"{'rows':>5} {'weight [N, K]':>14} {'fp32 ms':>9} {'GFLOP/s':>8} {'int8 ms':>9} {'int8 / fp32 speed':>18}")
    for m in args.rows:
        for n, k in SHAPES:
            lin = torch.nn.Linear(k, n, bias=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
            x, w = torch.randn(m, k), lin.weight.detach()
            a, b = best_time(lambda: F.linear(x, w)), best_time(lambda: q(x))
            print(f"{m:>5} {str([n, k]):>14} {a * 1e3:>9.3f} {2 * m * n * k / a / 1e9:>8.0f} {b * 1e3:>9.3f} {a / b:>17.2f}x")


if __name__ == "__main__":
    main()
