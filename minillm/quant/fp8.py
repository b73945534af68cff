"""fp8 (e4m3) weights with one scale per output channel.

    scale[n] = max_k |W[n, k]| / 448          W ~= float(q) * scale[:, None]

448 is e4m3's largest finite value. e4m3 keeps 3 mantissa bits, so the error is relative
(at most 1/16 of a value, after scaling) rather than a fixed step. Hopper GPUs multiply fp8
directly; on the CPU torch can store and cast float8_e4m3fn but not multiply it, so minillm
emulates: it dequantizes to the model dtype and multiplies there (a reference, not a speed-up).
"""

from __future__ import annotations

import torch

from .int8 import per_channel_scale

FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q float8_e4m3fn [N, K], scale fp32 [N])."""
    w, scale = per_channel_scale(w, FP8_MAX, "quantize_fp8")
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q float8_e4m3fn [N, K], scale [N]) -> W [N, K] in dtype."""
    return (q.float() * scale.float()[:, None]).to(dtype)
