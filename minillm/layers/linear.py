"""Linear layers. Q/K/V and gate/up are fused into one matrix each, so decode reads the
input once and launches one matmul instead of three (two)."""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). W: [out_features, in_features], as in checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
