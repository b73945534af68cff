"""Int8Linear: int8 weights, one scale per output channel (minillm/quant/int8.py).

Paths: "int8pack" on the CPU (`aten._weight_int8pack_mm`: bf16 activations and bf16 scales,
weight-only, for in_features a multiple of 16; the op streams the int8 matrix only with bf16
activations); "triton" on CUDA GPUs (kernels/quant_matmul.py int8_matmul); "dequant" otherwise.
"""

from __future__ import annotations

import torch

from .int8 import dequantize_int8, quantize_int8
from .linear import ChannelLinear


class Int8Linear(ChannelLinear):
    """Built from a float weight [out_features, in_features] (the weight is not kept):
    Int8Linear(weight, bias=None, fast=True, input_scale=None)."""

    weight_dtype = "int8"
    quantize = staticmethod(quantize_int8)
    dequantize = staticmethod(dequantize_int8)

    def choose_path(self, fast: bool, weight: torch.Tensor) -> str:
        if fast and weight.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm") and self.in_features % 16 == 0:
            return "int8pack"
        return self.gpu_path(fast, weight)

    @torch.no_grad()
    def int8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale fp32 [N]): W = q * scale[:, None] (minillm/quant/int8.py)."""
        return self.q, self.scale.float()

    def _cpu_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2d.to(torch.bfloat16), self.q, self.scale)

    def _triton_matmul(self, quant_matmul, x2d: torch.Tensor) -> torch.Tensor:
        return quant_matmul.int8_matmul(x2d, self.q, self.scale)
