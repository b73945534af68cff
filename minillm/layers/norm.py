"""RMSNorm, computed in fp32 like the reference implementation.

`ops` (the pass's ForwardContext.ops, layers/context.py) picks who computes it: "torch" (this file),
"triton" (the fused kernel, kernels/rmsnorm.py) or "cpu" (minillm's CPU kernel, kernels/cpu.py); with
either kernel `add_and_norm` fuses the residual add into the norm.

With `rotation` set (a b x b orthonormal matrix; models/calibrate/rotate.py's rotate_norm_outputs sets it
for weight_calibration="gptq"), the normed output leaves rotated block by block
(quant/rotate.py): the matrices it feeds store W H instead of W, so the float model is unchanged.
"""

import torch
from torch import nn

from ..kernels import cpu
from ..quant.rotate import rotate_blocks


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.register_buffer("rotation", None, persistent=False)

    def forward(self, x: torch.Tensor, ops: str = "torch") -> torch.Tensor:
        if ops == "triton":
            from ..kernels import rmsnorm  # imported late: the interpreter is chosen before triton is imported

            return self.rotated(rmsnorm.rmsnorm(x, self.weight, self.eps))
        if ops == "cpu":
            return self.rotated(cpu.rmsnorm(x, self.weight, self.eps))
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.rotated(self.weight * x32.to(dtype))

    def rotated(self, y: torch.Tensor) -> torch.Tensor:
        """The normed output as the next matrix takes it: rotated block by block when `rotation` is set."""
        return y if self.rotation is None else rotate_blocks(y, self.rotation)

    def add_and_norm(self, x: torch.Tensor | None, residual: torch.Tensor,
                     ops: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x None: (norm(residual), residual).

        The Triton and CPU kernels write residual + x into `residual` in place (one pass over memory).
        """
        if x is None:
            return self(residual, ops), residual
        if ops == "triton":
            from ..kernels import rmsnorm

            return self.rotated(rmsnorm.rmsnorm(x, self.weight, self.eps, residual=residual)), residual
        if ops == "cpu":
            return self.rotated(cpu.rmsnorm(x, self.weight, self.eps, residual=residual)), residual
        residual = residual + x
        return self(residual), residual
