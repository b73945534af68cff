"""Int4Linear: int4 weights in groups of input channels, two per byte (minillm/quant/int4.py).

in_features is padded with zero columns to a multiple of the group size (they meet zero
activations). Scales and zeros are stored in bfloat16, what the kernels take.

Paths: "cpu" on the CPU when minillm's CPU kernels are built (kernels/cpu.py `mm_i4` on its own
packed layout, cpu.pack_i4: activations rounded to int8 in blocks of 32 and multiplied in integers,
for fp32 models whose padded in_features is a multiple of 32; more than QUANT_KERNEL_ROWS rows (a long prefill)
multiply the dequantized matrix with F.linear); "int4pack" on the CPU otherwise (`aten._weight_int4pack_mm_for_cpu` on torch's own packed layout,
quant/int4pack.py: bf16 activations, out_features a multiple of 16; the weights stay 4-bit in
memory); "triton" on CUDA GPUs (kernels/int4_matmul.py on the plain layout);
"dequant" otherwise (the plain layout too). The plain layout is canonical: int4_parts() returns
it on every path ("int4pack" recovers it from the kernel's layout once, and caches it; "cpu" unpacks
its layout on each call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu
from . import int4pack
from .int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from .linear import GROUP_SIZES, QuantizedLinear


class Int4Linear(QuantizedLinear):
    """Built from a float weight [out_features, in_features] (the weight is not kept), or from int4
    levels computed elsewhere: quantized=(q [N, Kp] in 0..15, scale [N, Kp/g], zero [N, Kp/g]) of
    weight * input_scale, stored as given (scale and zero rounded to bf16)."""

    weight_dtype = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 128,
                 fast: bool = True, input_scale: torch.Tensor | None = None,
                 quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        if group_size not in GROUP_SIZES:
            raise ValueError(f"weight_group_size={group_size!r} is not one of {GROUP_SIZES}")
        super().__init__(weight, bias, input_scale)
        self.group_size = group_size
        self.pad = (-self.in_features) % group_size
        self._int4_cache = None  # "int4pack": the plain layout, recovered once (int4_parts)
        w = self.float_weight(weight, input_scale)
        if quantized is not None:  # already on the int4 grid (e.g. GPTQ): stored as given
            q, scale, zero = (t.to(w.device) for t in self._check_quantized(quantized))
        else:
            q, scale, zero = quantize_int4(F.pad(w, (0, self.pad)) if self.pad else w, group_size)
        scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
        on_cpu = fast and weight.device.type == "cpu"
        if on_cpu and weight.dtype == torch.float32 and q.shape[1] % cpu.INT4_BLOCK == 0 and cpu.available():
            self.path = "cpu"
            self.register_buffer("packed", cpu.pack_i4(q))
            self.register_buffer("scale", scale.float())   # the bf16-rounded values, as every path multiplies by
            self.register_buffer("zero", zero.float())
        elif on_cpu and int4pack.available() and self.out_features % 16 == 0:
            self.path = "int4pack"
            packed, scales_and_zeros = int4pack.pack(q, scale, zero)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", scales_and_zeros)
        else:
            self.path = self.gpu_path(fast, weight)
            self.register_buffer("packed", pack_int4(q))
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)

    def _check_quantized(self, quantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K_pad] in 0..15, scale [N, K_pad/g], zero [N, K_pad/g]) given to the constructor,
        checked against this layer's shape."""
        q, scale, zero = quantized
        n, kp = self.out_features, self.in_features + self.pad
        want = (n, kp // self.group_size)
        if tuple(q.shape) != (n, kp) or tuple(scale.shape) != want or tuple(zero.shape) != want:
            raise ValueError(f"quantized= parts q {tuple(q.shape)}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)} "
                             f"do not match: expected q ({n}, {kp}) and scale, zero {want}")
        if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
            raise ValueError(f"quantized= q holds values in [{int(q.min())}, {int(q.max())}], int4 levels are 0..15")
        return q.to(torch.uint8), scale.float(), zero.float()

    @torch.no_grad()
    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed uint8 [N, Kp/2], scale fp32 [N, Kp/g], zero fp32 [N, Kp/g]), pack_int4's format
        (Kp = in_features + pad, a multiple of group_size g): W = dequantize_int4(unpack_int4(packed),
        scale, zero)[:, :in_features], exactly the matrix dequantized_weight() returns."""
        if self.path == "cpu":
            return pack_int4(cpu.unpack_i4(self.packed)), self.scale, self.zero
        if self.path != "int4pack":
            return self.packed, self.scale.float(), self.zero.float()
        if self._int4_cache is None:
            self._int4_cache = int4pack.recover(self.packed, self.scales_and_zeros, self.out_features,
                                                self.in_features + self.pad, self.group_size)
        return self._int4_cache

    @torch.no_grad()
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [out_features, in_features] matrix this layer multiplies by (input_scale folded in
        when given: it multiplies x / input_scale)."""
        packed, scale, zero = self.int4_parts()
        return dequantize_int4(unpack_int4(packed), scale, zero)[:, : self.in_features].to(dtype or self.act_dtype)

    def _rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered from the plain layout, or straight from the "int4pack" layout when this torch
        build's is known (else from the recovered plain layout)."""
        if self.path == "cpu":
            q, scale, zero = cpu.unpack_i4(self.packed[ids]), self.scale[ids], self.zero[ids]
        elif self.path != "int4pack":
            q, scale, zero = unpack_int4(self.packed[ids]), self.scale[ids].float(), self.zero[ids].float()
        else:
            got = None if self._int4_cache is not None else \
                int4pack.rows(self.packed, self.scales_and_zeros, ids, self.in_features + self.pad)
            if got is None:
                packed, scale, zero = self.int4_parts()
                got = unpack_int4(packed[ids]), scale[ids], zero[ids]
            q, scale, zero = got
        return dequantize_int4(q, scale, zero)[:, : self.in_features].to(dtype)

    def _cpu_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.path == "cpu":
            if x2d.shape[0] > cpu.QUANT_KERNEL_ROWS:   # dequantized straight from the CPU layout
                w = dequantize_int4(cpu.unpack_i4(self.packed), self.scale, self.zero)[:, : self.in_features]
                return F.linear(x2d.float(), w)
            pad = (-self.in_features) % cpu.INT4_BLOCK   # to whole blocks of 32, not to the group: mm_i4 skips the rest
            x = F.pad(x2d.float(), (0, pad)) if pad else x2d.float()
            return cpu.mm_i4(x if x.is_contiguous() else x.contiguous(), self.packed, self.scale, self.zero,
                             self.group_size)
        xb = x2d.to(torch.bfloat16)
        return int4pack.matmul(F.pad(xb, (0, self.pad)) if self.pad else xb, self.packed, self.group_size,
                               self.scales_and_zeros)

    def _triton_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        # imported late: the interpreter is chosen before triton is imported
        from ..kernels.int4_matmul import int4_matmul

        return int4_matmul(x2d, self.packed, self.scale, self.zero, self.group_size)
