"""Linear layers. Q/K/V and gate/up are fused into one matrix each, so decode reads the
input once and launches one matmul instead of three (two).

`linear(x, W, b)` is F.linear with one CPU change. MKL's fp32 GEMM takes a slow path for
x @ W^T when x has 2 to a few dozen rows (decode of a small batch): a [4, 576] x [576, 3072]
product ran at a third of its memory-bandwidth time. The same product written the other way
round, (W @ x^T)^T, with the row count rounded up to 2, 4, 8, 16 or a multiple of 16, streams
W at bandwidth. Measured over SmolLM2-135M's 30 layers and head on 2 EPYC cores (one decode
step's matmuls; `scripts/cpu_linear_sweep.py` prints this table):

    rows            1     2     4     8    16    32    64
    F.linear (ms)  27    44    77    78    97   113   162
    linear() (ms)  27    25    27    50    54    78   124

Above MAX_ROWS rows (prefill) the gain shrinks (256 rows: 468 vs 416 ms before the copy back
to row-major is counted), so those keep F.linear.

With minillm's CPU kernels built (kernels/cpu.py), up to cpu.KERNEL_ROWS (16) rows go to
`cpu.mm_f32` instead, which streams each weight row once at nearly the machine's read bandwidth
(the same step, ms: 28 / 42 / 36 / 51 / 73 for 1 / 2 / 4 / 8 / 16 rows, against the table's second
row measured again beside it: 41 / 42 / 40 / 81 / 102; `scripts/cpu_linear_sweep.py` prints both).

Same arithmetic (each output is one row of W dotted with one row of x); only the summation
order inside MKL may differ, so results agree to float rounding. GPUs and other dtypes keep
F.linear.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu

MAX_ROWS = 64   # above this F.linear is as fast (prefill), and the transposing copy would cost


def padded_rows(m: int) -> int:
    """Row count the CPU path multiplies (m <= MAX_ROWS): 2, 4, 8, 16, then multiples of 16."""
    if m <= 16:
        b = 2
        while b < m:
            b *= 2
        return b
    return -(-m // 16) * 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K] (row-major), bias: [N] or None -> [..., N]."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 \
            or not weight.is_contiguous() or x.numel() > MAX_ROWS * x.shape[-1]:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m <= cpu.KERNEL_ROWS and cpu.available():
        return cpu.mm_f32(x2 if x2.is_contiguous() else x2.contiguous(), weight, bias).view(*lead, weight.shape[0])
    rows = padded_rows(m)
    if rows != m:
        x2 = torch.cat([x2, x2.new_zeros(rows - m, x2.shape[1])])
    y = torch.mm(weight, x2.t())[:, :m].t().contiguous()   # [N, rows] -> [m, N]
    if bias is not None:
        y += bias
    return y.view(*lead, weight.shape[0])


class Linear(nn.Module):
    """y = x W^T (+ b). W: [out_features, in_features], as in checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
