"""Signed-gradient rounding (SignRound / AutoRound, Cheng et al. 2023) for int4 weights.

Round-to-nearest picks each weight's level on its own; AWQ and GPTQ improve on it with a few
closed-form steps. Here the rounding itself is learned: every weight gets an offset v in
[-0.5, 0.5] added before rounding (so it can only move to the level just above or below), and
every group gets two range parameters (how wide its grid is, and where its centre sits). They are
trained by sign gradient descent so that a whole decoder layer's output, with all of its
matrices quantized together, matches the float layer's output on calibration text:

    q = clamp(round((w - lo) / scale + v), 0, 15),   w_hat = q * scale + lo,
    scale = 2 h a / 15,   lo = c + b h - h a          (h, c: half-range and centre of the group;
                                                       a = 1, b = 0 at the start)

round() passes gradients straight through (the straight-through estimator). Each step moves
every parameter by the learning rate times the sign of its gradient, the update SignRound uses:
the offsets only need a direction, and the step size bounds how far they travel in total.

LearnableInt4 holds one matrix's parameters; models/calibrate/autoround.py calibrate_autoround runs the
layer-by-layer training. The stored format is minillm's ordinary int4 (quant/int4.py): export()
returns (q, scale, zero) as QuantizedLinear takes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .int4 import QMAX, _check, dequantize_int4

RANGE_LIMITS = (0.5, 1.2)   # a: a group's grid may shrink to half its range or widen by 20%
SHIFT_LIMIT = 0.3           # b: its centre may move by 30% of the half-range


def ste_round(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (the straight-through estimator)."""
    return x + (x.round() - x).detach()


class LearnableInt4:
    """One int4 matrix with learnable rounding offsets and group ranges.

    w [N, K]: the float weight. input_scale [K] (AWQ's, or None): the grid is learned for
    w * input_scale, and weight() divides it back out, so x @ weight().T stands in for the layer.
    clip [N, groups, 2] (AWQ's search_clip bounds, or None): each group's starting range; the
    default is the group's min / max (round-to-nearest at the start).
    """

    def __init__(self, w: torch.Tensor, group_size: int = 128, input_scale: torch.Tensor | None = None,
                 clip: torch.Tensor | None = None):
        n, k = w.shape
        self.k, self.group_size = k, group_size
        self.input_scale = None if input_scale is None else input_scale.detach().float().to(w.device)
        ws = w.detach().float() * (1 if self.input_scale is None else self.input_scale)
        ws = F.pad(ws, (0, (-k) % group_size))
        _check(ws, group_size)
        self.ws = ws.reshape(n, -1, group_size)                             # [N, groups, g]
        lo, hi = self.ws.amin(dim=2), self.ws.amax(dim=2)
        if clip is not None:
            if clip.shape != lo.shape + (2,):
                raise ValueError(f"clip has shape {tuple(clip.shape)}, expected {tuple(lo.shape) + (2,)}")
            clip = clip.detach().float().to(w.device)
            lo, hi = torch.maximum(lo, clip[..., 0]), torch.minimum(hi, clip[..., 1])
            hi = torch.maximum(hi, lo)
        self.centre, self.half = (lo + hi) / 2, ((hi - lo) / 2).clamp_min(1e-8)
        self.a = torch.ones_like(self.centre, requires_grad=True)          # range multiplier
        self.b = torch.zeros_like(self.centre, requires_grad=True)         # centre shift / half-range
        self.v = torch.zeros_like(self.ws, requires_grad=True)             # rounding offsets

    def parameters(self) -> list[torch.Tensor]:
        return [self.a, self.b, self.v]

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.half * self.a
        lo = self.centre + self.b * self.half - half
        return (2 * half / QMAX).clamp_min(1e-10), lo

    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] (fp32), differentiable in a, b and v."""
        scale, lo = self._grid()
        q = torch.clamp(ste_round((self.ws - lo[..., None]) / scale[..., None] + self.v), 0, QMAX)
        w = (q * scale[..., None] + lo[..., None]).reshape(self.ws.shape[0], -1)[:, :self.k]
        return w if self.input_scale is None else w / self.input_scale

    @torch.no_grad()
    def sign_step(self, lr: float) -> None:
        """One signed-gradient step of every parameter, then each back into its range."""
        for p, (low, high) in ((self.a, RANGE_LIMITS), (self.b, (-SHIFT_LIMIT, SHIFT_LIMIT)), (self.v, (-0.5, 0.5))):
            if p.grad is not None:
                p -= lr * p.grad.sign()
                p.clamp_(low, high)
                p.grad = None

    def state(self) -> tuple[torch.Tensor, ...]:
        """A copy of the parameters (calibrate_autoround goes back to the start's when training ends worse)."""
        return tuple(p.detach().clone() for p in self.parameters())

    @torch.no_grad()
    def load_state(self, state: tuple[torch.Tensor, ...]) -> None:
        for p, value in zip(self.parameters(), state):
            p.copy_(value)

    @torch.no_grad()
    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q uint8 [N, K_pad] in 0..15, scale fp32 [N, groups], zero fp32 [N, groups]) of w * input_scale,
        with scale and zero rounded to bfloat16 as QuantizedLinear stores them (the levels are chosen
        on that grid)."""
        scale, lo = self._grid()
        scale, lo = scale.to(torch.bfloat16).float(), lo.to(torch.bfloat16).float()
        q = torch.clamp(torch.round((self.ws - lo[..., None]) / scale[..., None] + self.v), 0, QMAX)
        return q.to(torch.uint8).reshape(self.ws.shape[0], -1).cpu(), scale.cpu(), lo.cpu()

    @torch.no_grad()
    def stored_weight(self) -> torch.Tensor:
        """The [N, K] matrix QuantizedLinear will multiply by once export()ed (bf16 grid, input_scale divided out)."""
        w = dequantize_int4(*self.export())[:, :self.k].to(self.ws.device)
        return w if self.input_scale is None else w / self.input_scale
