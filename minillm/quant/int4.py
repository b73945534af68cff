"""int4 weights: group-wise asymmetric, round to nearest, two weights per byte.

Each row of W [N, K] is cut into K / group_size groups of consecutive input channels. A group
with minimum lo and maximum hi gets

    scale = (hi - lo) / 15,   zero = lo,   q = round((w - zero) / scale) in [0, 15],
    w ~= q * scale + zero

so the error is at most scale / 2 = (hi - lo) / 30 per group. `zero` is the group's minimum as
a float (the way GGUF's Q4_1 stores "scale and min", and the way torch's int4 CPU kernel takes
"scales and zeros"), not an integer zero point.

Note: SmolLM2-135M's weights in minillm come from a Q4_1 GGUF file (4 bits, groups of 32 with
a scale and a minimum). int4 with group_size=32, aligned to those blocks, re-finds nearly the
same 16 levels per block and is nearly lossless on that model for that reason alone; larger
groups (64, 128) and models never quantized before show the real loss.

Packing: byte j of a row holds q[2j] in its low nibble and q[2j+1] in its high nibble.
"""

from __future__ import annotations

import torch

QMAX = 15


def _check(w: torch.Tensor, group_size: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"int4 quantization expects a [out_features, in_features] matrix, got shape {tuple(w.shape)}")
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size={group_size!r} must be an even integer >= 2")
    if w.shape[1] % group_size:
        raise ValueError(f"in_features={w.shape[1]} is not a multiple of group_size={group_size}; "
                         f"pad the matrix with zero columns (QuantizedLinear does) or pick a group size that divides it")


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q uint8 [N, K] in 0..15 (unpacked), scale fp32 [N, K/g], zero fp32 [N, K/g])."""
    _check(w, group_size)
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = (hi - lo) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0, w = zero
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, QMAX).to(torch.uint8)
    return q.reshape(n, k), scale, lo


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q uint8 [N, K] in 0..15 (unpacked; see unpack_int4), scale [N, K/g], zero [N, K/g]) -> W [N, K] in dtype."""
    n, k = q.shape
    groups = scale.shape[1]
    if scale.shape != zero.shape or scale.shape[0] != n or k % groups:
        raise ValueError(f"q {tuple(q.shape)}, scale {tuple(scale.shape)} and zero {tuple(zero.shape)} do not match: "
                         "expected scale and zero of shape [N, K / group_size]")
    w = q.float().reshape(n, groups, k // groups) * scale.float()[..., None] + zero.float()[..., None]
    return w.reshape(n, k).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 in 0..15, K even -> [N, K/2] uint8 (low nibble = even column)."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> q [N, K] uint8 in 0..15 (inverse of pack_int4)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
