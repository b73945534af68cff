"""int8 weights: per-output-channel symmetric, round to nearest.

    scale[n] = max_k |W[n, k]| / 127          W ~= q * scale[:, None],  q in [-127, 127]

One scale per output row, so the error on row n is at most scale[n] / 2.
"""

from __future__ import annotations

import torch

QMAX = 127


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], scale fp32 [N]). An all-zero row gets scale 1."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 expects a [out_features, in_features] matrix, got shape {tuple(w.shape)}")
    w = w.float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [N, K], scale [N]) -> W [N, K] in dtype."""
    return (q.float() * scale.float()[:, None]).to(dtype)
