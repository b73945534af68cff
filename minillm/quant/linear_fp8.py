"""Fp8Linear: fp8 (e4m3) weights, one scale per output channel (minillm/quant/fp8.py).

Paths: "triton" on CUDA GPUs that have the fp8 kernels (kernels/channel_matmul.py fp8_supported,
hardware.GPU_FEATURES["fp8_matmul"]); "dequant" everywhere else, the CPU included (torch stores
float8_e4m3fn there but does not multiply it).
"""

from __future__ import annotations

import torch

from .fp8 import dequantize_fp8, quantize_fp8
from .linear import ChannelLinear


class Fp8Linear(ChannelLinear):
    """Built from a float weight [out_features, in_features] (the weight is not kept):
    Fp8Linear(weight, bias=None, fast=True, input_scale=None)."""

    weight_dtype = "fp8"
    quantize = staticmethod(quantize_fp8)
    dequantize = staticmethod(dequantize_fp8)

    def choose_path(self, fast: bool, weight: torch.Tensor) -> str:
        return "triton" if self.gpu_path(fast, weight) == "triton" and _has_fp8_kernels(weight.device) else "dequant"

    def _triton_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        # imported late: the interpreter is chosen before triton is imported
        from ..kernels.channel_matmul import fp8_matmul

        return fp8_matmul(x2d, self.q, self.scale)


def _has_fp8_kernels(device: torch.device) -> bool:
    from ..kernels.channel_matmul import fp8_supported  # imported late, as forward imports the kernels

    return fp8_supported(device)
