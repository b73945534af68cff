"""Activation-aware scale search (AWQ, Lin et al. 2023), round-to-nearest inside.

A few input channels carry much larger activations than the rest; their weights matter more.
AWQ multiplies column k of W by s[k] > 1 for such channels before quantizing (finer levels
relative to those weights) and divides x[:, k] by s[k], which leaves x W^T unchanged in exact
arithmetic. Per matrix it tries

    s = mean_t |x[t, k]| ** alpha,  normalised so that sqrt(max(s) * min(s)) = 1,  alpha in [0, 1)

and keeps the alpha whose quantized output is closest to the float output on calibration
activations x (alpha = 0 is plain round-to-nearest, so the search never does worse on them).
`QuantizedLinear.from_float(..., input_scale=s)` is the hook that applies the result; the activations come
from running the float model on calibration text (minillm/data/calibration.txt, kept apart
from corpus.txt, which the quality harness scores), which the model
floor does (this floor only sees tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import dequantize_fp8, quantize_fp8
from .int4 import dequantize_int4, quantize_int4
from .int8 import dequantize_int8, quantize_int8


def fake_quantize(w: torch.Tensor, weight_dtype: str, group_size: int = 128) -> torch.Tensor:
    """dequantize(quantize(w)) in fp32, [N, K] -> [N, K] (int4 pads K to a multiple of the group)."""
    if weight_dtype == "int8":
        return dequantize_int8(*quantize_int8(w))
    if weight_dtype == "fp8":
        return dequantize_fp8(*quantize_fp8(w))
    k = w.shape[1]
    pad = (-k) % group_size
    wp = F.pad(w.float(), (0, pad)) if pad else w.float()
    return dequantize_int4(*quantize_int4(wp, group_size))[:, :k]


@torch.no_grad()
def search_input_scale(w: torch.Tensor, x: torch.Tensor, weight_dtype: str = "int4", group_size: int = 128,
                       grid: int = 20, module=None) -> tuple[torch.Tensor, float, list[float]]:
    """w [N, K], calibration inputs x [T, K] -> (input_scale [K], best alpha, output error per alpha).

    The error is the mean squared difference between x W^T and (x / s) Q(W s)^T, or, given
    `module(x, w) -> output` (the block the matrix feeds, e.g. attention and o_proj after a QKV
    matrix, with the rest of the block in float), between module(x, W) and module(x / s, Q(W s)):
    what llm-awq scores, since an error that the block's nonlinearity or softmax damps costs less.
    """
    w, x = w.float(), x.float().reshape(-1, w.shape[1])
    module = module or (lambda inp, weight: inp @ weight.t())
    ref = module(x, w)
    mean_abs = x.abs().mean(dim=0).clamp_min(1e-8)
    best, best_alpha, errors = None, 0.0, []
    for i in range(grid):
        alpha = i / grid
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        out = module(x / s, fake_quantize(w * s, weight_dtype, group_size))
        err = float((out - ref).pow(2).mean())
        errors.append(err)
        if best is None or err < min(errors[:-1]):
            best, best_alpha = s, alpha
    return best, best_alpha, errors


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, group_size: int = 128, input_scale: torch.Tensor | None = None,
                grid: int = 20, max_shrink: float = 0.5, two_sided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's second step: a per-group clipping range for int4. w [N, K], calibration inputs x [T, K]
    -> (bounds [N, K_pad / group_size, 2] = (low, high) per group, output error [N, groups] there).

    Each group of W' = W * input_scale is clamped to [low, high], then quantized (round to
    nearest on the min / max of the clamped group); per group the range with the least error on
    that group's share of the output, E_t[(x'_tg . (Q(W'_ng) - W'_ng))^2] with x' = x / input_scale,
    is kept. Clipping a few outlying weights buys finer levels for the rest of the group.

    two_sided=False (AWQ's search): [-m, m] with m = r * max|group|, r = 1, 1 - 1/grid, ...,
    1 - max_shrink. two_sided=True (for asymmetric int4): low = lo + a (hi - lo) and
    high = hi - b (hi - lo) with a, b each in 0, 1/grid, ..., max_shrink / 2 (all pairs).
    Both include "no clipping", so the result never does worse than round-to-nearest on the
    calibration inputs. The error is computed exactly from each group's input covariance
    C_g = E_t[x'_tg x'_tg^T] (d^T C_g d per row and group): its cost does not grow with the tokens.
    """
    if not 0 <= max_shrink < 1:
        raise ValueError(f"max_shrink={max_shrink!r} must be in [0, 1)")
    n, k = w.shape
    s = torch.ones(k) if input_scale is None else input_scale.detach().float().cpu()
    ws = w.detach().float().cpu() * s
    xs = x.detach().float().cpu().reshape(-1, k) / s
    pad = (-k) % group_size
    if pad:
        ws, xs = F.pad(ws, (0, pad)), F.pad(xs, (0, pad))
    groups = ws.shape[1] // group_size
    xg = xs.reshape(-1, groups, group_size).transpose(0, 1)            # [G, T, g]
    cov = xg.transpose(1, 2) @ xg / xg.shape[1]                        # [G, g, g]
    wg = ws.reshape(n, groups, group_size)
    if two_sided:
        lo, hi = wg.amin(dim=2), wg.amax(dim=2)
        steps = [i / grid for i in range(int(round(max_shrink / 2 * grid)) + 1)]
        candidates = [(lo + a * (hi - lo), hi - b * (hi - lo)) for a in steps for b in steps]
    else:
        org_max = wg.abs().amax(dim=2)                                 # [N, G]
        candidates = [(-org_max * (1 - i / grid), org_max * (1 - i / grid))
                      for i in range(int(round(max_shrink * grid)) + 1)]
    best_err = torch.full((n, groups), float("inf"))
    best = torch.stack(candidates[0], dim=-1)
    for low, high in candidates:
        clipped = torch.maximum(torch.minimum(wg, high[..., None]), low[..., None])
        d = (dequantize_int4(*quantize_int4(clipped.reshape(n, -1), group_size)).reshape(n, groups, group_size) - wg)
        dt = d.transpose(0, 1)                                         # [G, N, g]
        err = ((dt @ cov) * dt).sum(-1).t()                            # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], torch.stack([low, high], dim=-1), best)
    return best, best_err
