"""int8 weights: per-output-channel symmetric, round to nearest.

    scale[n] = max_k |W[n, k]| / 127          W ~= q * scale[:, None],  q in [-127, 127]

One scale per output row, so the error on row n is at most scale[n] / 2.
"""

from __future__ import annotations

import torch

QMAX = 127


def per_channel_scale(w: torch.Tensor, qmax: float, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w in fp32, symmetric scale fp32 [N] mapping each row's largest |value| to qmax;
    an all-zero row gets scale 1). `who` names the caller in the error."""
    if w.dim() != 2:
        raise ValueError(f"{who} expects a [out_features, in_features] matrix, got shape {tuple(w.shape)}")
    w = w.float()
    scale = w.abs().amax(dim=1) / qmax
    return w, torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], scale fp32 [N]). An all-zero row gets scale 1."""
    w, scale = per_channel_scale(w, QMAX, "quantize_int8")
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [N, K], scale [N]) -> W [N, K] in dtype."""
    return (q.float() * scale.float()[:, None]).to(dtype)
