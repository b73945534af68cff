"""RMSNorm, computed in fp32 like the reference implementation.

With `use_triton` set (the model sets it for attention_backend="triton"), the fused Triton
kernel runs instead (kernels/rmsnorm.py), and `add_and_norm` fuses the residual add into it.
"""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from ..kernels import rmsnorm  # imported late: the interpreter is chosen before triton is imported

            return rmsnorm.rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor | None, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x None: (norm(residual), residual).

        The Triton path writes residual + x into `residual` in place (one pass over memory).
        """
        if x is None:
            return self(residual), residual
        if self.use_triton:
            from ..kernels import rmsnorm

            return rmsnorm.rmsnorm(x, self.weight, self.eps, residual=residual), residual
        residual = residual + x
        return self(residual), residual
