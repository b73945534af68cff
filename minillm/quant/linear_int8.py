"""Int8Linear: int8 weights, one scale per output channel (minillm/quant/int8.py).

Paths: "cpu" on the CPU when minillm's CPU kernels are built (kernels/cpu.py `mm_i8`: fp32 activations
times int8 weights converted in registers, for fp32 models; more than QUANT_KERNEL_ROWS rows (a long prefill)
multiply the dequantized matrix with F.linear); "int8pack" on the CPU otherwise
(`aten._weight_int8pack_mm`: bf16 activations and bf16 scales, weight-only, for in_features a
multiple of 16; the op streams the int8 matrix only with bf16 activations); "triton" on CUDA GPUs
(kernels/channel_matmul.py int8_matmul); "dequant" otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu
from .int8 import dequantize_int8, quantize_int8
from .linear import ChannelLinear


class Int8Linear(ChannelLinear):
    """Built from a float weight [out_features, in_features] (the weight is not kept):
    Int8Linear(weight, bias=None, fast=True, input_scale=None)."""

    weight_dtype = "int8"
    quantize = staticmethod(quantize_int8)
    dequantize = staticmethod(dequantize_int8)

    def choose_path(self, fast: bool, weight: torch.Tensor) -> str:
        if fast and weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu.available():
            return "cpu"
        if fast and weight.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm") and self.in_features % 16 == 0:
            return "int8pack"
        return self.gpu_path(fast, weight)

    @torch.no_grad()
    def int8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale fp32 [N]): W = q * scale[:, None] (minillm/quant/int8.py)."""
        return self.q, self.scale.float()

    def _cpu_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.path == "int8pack":
            return torch._weight_int8pack_mm(x2d.to(torch.bfloat16), self.q, self.scale)
        x2d = x2d.float()
        if x2d.shape[0] > cpu.QUANT_KERNEL_ROWS:
            return F.linear(x2d, self.dequantized_weight(torch.float32))
        return cpu.mm_i8(x2d if x2d.is_contiguous() else x2d.contiguous(), self.q, self.scale)

    def _triton_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        # imported late: the interpreter is chosen before triton is imported
        from ..kernels.channel_matmul import int8_matmul

        return int8_matmul(x2d, self.q, self.scale)
