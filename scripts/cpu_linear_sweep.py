"""One decode step's matmuls on the CPU: F.linear vs torch.mm(W, x^T) vs minillm's CPU kernel, by row count.

Times the 30 layers' four projections and the 49152-row head of SmolLM2-135M (random fp32
weights of the real shapes, each matrix read from memory once per step, as in decode), for
1 to 256 rows (sequences in the step). Ratios, side by side in one run:

    .venv/bin/python scripts/cpu_linear_sweep.py [--rows 1 2 4 8 16 32 64 256] [--repeats 4]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from minillm.kernels import cpu
from minillm.layers.linear import padded_rows

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, intermediate 1536, vocab 49152, 30 layers.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)
NUM_LAYERS = 30


def transposed(x, w):
    """linear()'s torch path: (W @ x^T)^T with the rows padded to 2, 4, 8, 16 or a multiple of 16."""
    m = x.shape[0]
    rows = padded_rows(m) if m <= 64 else m
    if rows != m:
        x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
    return torch.mm(w, x.t())[:, :m].t().contiguous()


def step_ms(fn, weights, head, rows: int, repeats: int) -> float:
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}

    def run():
        for layer in weights:
            for w in layer:
                fn(xs[w.shape[1]], w)
        fn(xs[576], head)

    run()
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [[torch.randn(*s) for s in LAYER_SHAPES] for _ in range(NUM_LAYERS)]
    head = torch.randn(*HEAD_SHAPE)
    weight_mb = (sum(w.numel() for w in weights[0]) * NUM_LAYERS + head.numel()) * 4 / 1e6
    print(f"SmolLM2-135M-shaped matmuls, fp32, {weight_mb:.0f} MB of weights per step, "
          f"{torch.get_num_threads()} threads")
    print(f"{'rows':>5} {'F.linear ms':>12} {'W x^T ms':>10} {'kernel ms':>10} {'GB/s (kernel)':>14}")
    for rows in args.rows:
        a = step_ms(F.linear, weights, head, rows, args.repeats)
        b = step_ms(transposed, weights, head, rows, args.repeats)
        c = step_ms(cpu.mm_f32, weights, head, rows, args.repeats) if cpu.available() else float("nan")
        print(f"{rows:>5} {a:>12.1f} {b:>10.1f} {c:>10.1f} {weight_mb / c:>14.1f}")

if __name__ == "__main__":
    main()
