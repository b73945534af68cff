"""GPTQ (Frantar et al. 2022): int4 weights that minimise the layer's output error, not each weight's.

Round-to-nearest quantizes every weight on its own. GPTQ quantizes the columns of W [N, K] one
after another and, after each column, moves the error it just made onto the columns not yet
quantized, in the direction that least changes x W^T on calibration inputs x [T, K]. With the
input Hessian H = X^T X / T (of the squared output error), column k's error e = (w_k - q_k) / U_kk
is spread as W[:, k+1:] -= e U[k, k+1:], where U is the upper Cholesky factor of H^-1. Columns
are processed in blocks of 128 (the updates to later blocks are applied once per block).

Here, for minillm's int4 format (quant/int4.py: groups of `group_size` consecutive input channels,
asymmetric, scale = (hi - lo) / 15, zero = lo):

- each group's scale and zero come from the group's (already error-updated) weights when the loop
  reaches the group's first column, optionally shrunk by a per-group clipping range (AWQ's
  search_clip output, in the same [N, groups, 2] layout);
- scales and zeros are rounded to bfloat16 before use, as QuantizedLinear stores them, so the
  error feedback sees the grid the kernels really use; the result is (q uint8 [N, K_pad] in 0..15,
  scale, zero), which QuantizedLinear takes as is (`int4_parts=`);
- `damp` (1% of the mean diagonal of H) keeps H invertible when T is small or a channel is dead;
- act_order=True quantizes columns in order of decreasing H_kk (the most active inputs first, while
  the most columns remain to absorb their error). Groups stay consecutive channels: their scales and
  zeros are fixed from the weights before the loop ("static groups"), so the stored format is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .int4 import QMAX, _check

BLOCK = 128


def input_hessian(x: torch.Tensor) -> torch.Tensor:
    """Calibration inputs x [..., K] -> H = x^T x / T [K, K] in fp64 accumulation, returned fp32."""
    x = x.reshape(-1, x.shape[-1]).double()
    return (x.t() @ x / max(x.shape[0], 1)).float()


def _grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of a group range, rounded to bfloat16 as QuantizedLinear stores them."""
    scale = (hi - lo) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale.to(torch.bfloat16).float(), lo.to(torch.bfloat16).float()


@torch.no_grad()
def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, damp: float = 0.01,
              act_order: bool = False, clip: torch.Tensor | None = None, block: int = BLOCK
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K], input Hessian [K, K] (input_hessian) -> (q uint8 [N, K_pad] in 0..15, scale fp32
    [N, K_pad/g], zero fp32 [N, K_pad/g]); W ~= dequantize_int4(q, scale, zero)[:, :K].

    K is padded with zero columns (and zero Hessian rows) to a multiple of group_size, as
    QuantizedLinear pads. clip [N, K_pad/g, 2]: per group (low, high) bounds for the range.
    """
    if act_order not in (False, True, "static"):
        raise ValueError(f"act_order={act_order!r} must be False, True or 'static'")
    if block % group_size:
        raise ValueError(f"block={block} must be a multiple of group_size={group_size}")
    if not 0 <= damp < 1:
        raise ValueError(f"damp={damp!r} must be in [0, 1)")
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({k}, {k}) for w of shape {tuple(w.shape)}")
    pad = (-k) % group_size
    W = F.pad(w.detach().float().cpu(), (0, pad))
    H = F.pad(hessian.detach().float().cpu(), (0, pad, 0, pad)).double()
    _check(W, group_size)
    kp, groups = W.shape[1], W.shape[1] // group_size
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    bounds = None if clip is None else clip.detach().float().cpu()
    if bounds is not None and bounds.shape != (n, groups, 2):
        raise ValueError(f"clip has shape {tuple(bounds.shape)}, expected ({n}, {groups}, 2)")

    def group_grid(cols: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = cols.amin(dim=1), cols.amax(dim=1)
        if bounds is not None:
            lo, hi = torch.maximum(lo, bounds[:, g, 0]), torch.minimum(hi, bounds[:, g, 1])
            hi = torch.maximum(hi, lo)
        return _grid(lo, hi)

    scale = torch.empty(n, groups)
    zero = torch.empty(n, groups)
    diag = torch.diagonal(H)
    if act_order == "static":  # static groups: every group's grid from the weights before any update
        for g in range(groups):
            scale[:, g], zero[:, g] = group_grid(W[:, g * group_size:(g + 1) * group_size], g)
        perm = torch.argsort(diag, descending=True)
    elif act_order:  # groups stay contiguous: the most active group first, inside it the most active column
        order = torch.argsort(diag.reshape(groups, group_size).sum(1), descending=True)
        perm = torch.cat([g * group_size + torch.argsort(diag[g * group_size:(g + 1) * group_size], descending=True)
                          for g in order.tolist()])
    else:
        perm = torch.arange(kp)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diagonal(H).mean() * torch.eye(kp, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    Q = torch.zeros(n, kp)
    for b0 in range(0, kp, block):
        b1 = min(b0 + block, kp)
        W1, E1 = W[:, b0:b1].clone(), torch.zeros(n, b1 - b0)
        for i in range(b1 - b0):
            col = int(perm[b0 + i])
            g = col // group_size
            if act_order != "static" and (b0 + i) % group_size == 0:  # the loop reaches a new group: its grid now
                rest = torch.cat([W1[:, i:], W[:, b1:]], dim=1)[:, :group_size]
                scale[:, g], zero[:, g] = group_grid(rest, g)
            s, z = scale[:, g], zero[:, g]
            wcol = W1[:, i]
            qcol = torch.round((wcol - z) / s).clamp_(0, QMAX)
            Q[:, b0 + i] = qcol
            err = (wcol - (qcol * s + z)) / U[b0 + i, b0 + i]
            W1[:, i:] -= err[:, None] * U[b0 + i, b0 + i:b1][None, :]
            E1[:, i] = err
        W[:, b1:] -= E1 @ U[b0:b1, b1:]
    q = torch.empty_like(Q)
    q[:, perm] = Q
    return q.to(torch.uint8), scale, zero
