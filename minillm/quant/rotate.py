"""Hadamard rotation of a matrix's input channels, block by block (QuaRot, Ashkboos et al. 2024,
used here for weights only).

For an orthonormal H (H H^T = I), x W^T = (x H) (W H)^T: a layer that multiplies its input by H
and stores W H instead of W computes the same thing in exact arithmetic. Quantized, it does
not: W H spreads each weight over the block, so a group of int4 levels sees a smoother, more
Gaussian row with fewer outliers to stretch its range, and each rounding error is spread over
the block's inputs too. With H block-diagonal (one b x b Hadamard per block of b input
channels, b the int4 group size), the rotation stays inside each group and costs b multiply-adds
per input channel (for SmolLM2's down_proj, 128 per channel, ~1/5 of the matrix's own work on
one token and 4% of the model's).

Sylvester's construction: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]], scaled by 1 / sqrt(n), so
n must be a power of two.
"""

from __future__ import annotations

import torch


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal n x n Hadamard matrix (Sylvester); n a power of two."""
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"hadamard(n={n!r}): n must be a power of two >= 1")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(dtype=dtype, device=device)


def rotate_blocks(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x with each block of b = h.shape[0] consecutive channels multiplied by h [b, b]
    (x @ blockdiag(h, ..., h)); K must be a multiple of b."""
    b = h.shape[0]
    if x.shape[-1] % b:
        raise ValueError(f"rotate_blocks: {x.shape[-1]} channels are not a multiple of the block size {b}")
    return (x.reshape(-1, x.shape[-1] // b, b) @ h).reshape(x.shape)
