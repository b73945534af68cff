"""The int4 CPU kernel on a row padded to whole groups: x with the padding (zeros multiplied by the padded
levels, the work done before the kernel learned to stop) vs x without it (the padded tail never read), side by
side on the default model's shapes whose 576 inputs group size 128 pads to 640. Same bits both ways
(tests/test_cpu_kernels.py checks); this prints the time.

    .venv/bin/python scripts/cpu_int4_pad.py [--rows 1 4 16] [--group-size 128]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cpu_int8_gemm import best_time   # scripts/ is on the path when this runs as a script
from minillm.kernels import cpu

SHAPES = [(960, 576), (576, 576), (3072, 576)]   # SmolLM2-135M: qkv, o, gate_up (down's 1536 inputs need no pad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit("minillm's CPU kernels are not built here (no C compiler?): nothing to measure")
    g = args.group_size
    gen = torch.Generator().manual_seed(0)
    print(f"mm_i4, group size {g}, {torch.get_num_threads()} threads; microseconds per call, best of 5")
    print(f"{'N x K (padded)':>20} {'rows':>5} {'padded x':>10} {'unpadded x':>11} {'speed-up':>9}")
    for n, k in SHAPES:
        kp = k + (-k) % g
        packed = cpu.pack_i4(torch.randint(0, 16, (n, kp), generator=gen, dtype=torch.uint8))
        scale, zero = torch.rand(n, kp // g, generator=gen) / 10, torch.randn(n, kp // g, generator=gen) / 10
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            xp = F.pad(x, (0, kp - k))
            assert torch.equal(cpu.mm_i4(x, packed, scale, zero, g), cpu.mm_i4(xp, packed, scale, zero, g))
            padded = 1e6 * best_time(lambda: cpu.mm_i4(xp, packed, scale, zero, g), reps=1000, warmup=20)
            skip = 1e6 * best_time(lambda: cpu.mm_i4(x, packed, scale, zero, g), reps=1000, warmup=20)
            print(f"{f'{n} x {k} ({kp})':>20} {m:>5} {padded:>10.1f} {skip:>11.1f} {padded / skip:>8.2f}x")


if __name__ == "__main__":
    main()
