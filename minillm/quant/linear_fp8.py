"""Fp8Linear: fp8 (e4m3) weights, one scale per output channel (minillm/quant/fp8.py).

Paths: "triton" on CUDA GPUs that have the fp8 kernels (kernels/quant_matmul.py fp8_supported,
hardware.GPU_FEATURES["fp8_matmul"]); "dequant" everywhere else, the CPU included (torch stores
float8_e4m3fn there but does not multiply it).
"""

from __future__ import annotations

import torch

from .fp8 import dequantize_fp8, quantize_fp8
from .linear import ChannelLinear


class Fp8Linear(ChannelLinear):
    """Built from a float weight [out_features, in_features] (the weight is not kept)."""

    weight_dtype = "fp8"
    dequantize = staticmethod(dequantize_fp8)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, fast: bool = True,
                 input_scale: torch.Tensor | None = None):
        super().__init__(weight, bias, input_scale)
        q, scale = quantize_fp8(self.float_weight(weight, input_scale))
        self.path = self.gpu_path(fast, weight)
        if self.path == "triton":
            from ..kernels.quant_matmul import fp8_supported  # imported late, as forward does

            self.path = "triton" if fp8_supported(weight.device) else "dequant"
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    def _triton_matmul(self, quant_matmul, x2d: torch.Tensor) -> torch.Tensor:
        return quant_matmul.fp8_matmul(x2d, self.q, self.scale)
