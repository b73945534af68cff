"""QuantizedLinear: y = x W^T (+ b) with W stored in int8 / int4 / fp8, on the fastest path this
machine has for it.

One subclass per storage format, chosen at conversion by `QuantizedLinear.from_float(weight, bias,
weight_dtype, ...)`: Int8Linear (quant/linear_int8.py, per output channel), Int4Linear
(quant/linear_int4.py, group-wise) and Fp8Linear (quant/linear_fp8.py, per output channel). Each
picks its path at construction and names it in `.path`:

- "cpu": minillm's own CPU kernels (kernels/cpu.py, compiled on first use) for fp32 models: int8
  weights times fp32 activations; int4 weights times activations rounded to int8 per block of 32;
- a torch CPU kernel where minillm's are not built: "int8pack" (`aten._weight_int8pack_mm`) or
  "int4pack" (`aten._weight_int4pack_mm_for_cpu`, quant/int4pack.py), bf16 activations, weight-only;
- "triton" on CUDA GPUs (minillm/kernels/channel_matmul.py, int4_matmul.py; fp8 on the cards that have the fp8 kernels):
  the weights stay in their stored format and each kernel dequantizes its tile in registers. It stores
  the same buffers as "dequant" (tests flip `.path` to run it under the interpreter);
- "dequant" everywhere else (fast=False, odd shapes, fp8 on the CPU): dequantize the whole matrix to
  the activation dtype at each call, then F.linear. The reference: correct, and slow.

`dequantized_weight()` returns the matrix every path multiplies by, so tests compare each fast path
against F.linear with it (the CPU kernels round activations to bf16).

Plain layouts and a plug-in (what a lab's or a Triton kernel needs, whatever the path):
`int8_parts()` -> (q int8 [N, K], scale fp32 [N]); `int4_parts()` -> (packed uint8 [N, Kp/2], scale
fp32 [N, Kp/g], zero fp32 [N, Kp/g]) in minillm/quant/int4.py's format (Kp = in_features padded to
the group size). `forward(x, matmul=fn)` computes y = fn(x2d, layer) instead of the path (x2d [M, K]
in the activation dtype, after the input_scale division; bias added after): an engine built with
`quantized_matmul=fn` (seams.QuantizedMatmul) passes its fn on every pass; the layer keeps none.

Rows: `rows(ids)` -> dequantized_weight()[ids], dequantizing only those rows; a tied embedding is
looked up there. `quantized=(q, scale, zero)` (int4 only) stores levels computed elsewhere (GPTQ,
minillm/quant/gptq.py) as given.

Activation-aware hook: `input_scale` [K] (e.g. from an AWQ-style search on calibration text)
quantizes W * input_scale and multiplies x by 1 / input_scale first, so y is unchanged in exact
arithmetic while salient input channels get finer quantization levels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import WEIGHT_DTYPES
from ..config import WEIGHT_GROUP_SIZES as GROUP_SIZES

_FORMATS: dict[str, type[QuantizedLinear]] = {}  # weight_dtype -> its class, filled as each is defined


def quantized_matrix_bytes(out_features: int, in_features: int, weight_dtype: str, group_size: int | None = 128) -> int:
    """Bytes of one stored [out, in] matrix (no bias, no input scale): int8 / fp8 one byte per weight
    and an fp32 scale per row; int4 half a byte per weight (in_features padded to the group) and a
    bf16 scale and zero per group (group_size: int4's only)."""
    if weight_dtype in ("int8", "fp8"):
        return out_features * in_features + 4 * out_features
    if weight_dtype == "int4":
        k = in_features + (-in_features) % group_size
        return out_features * k // 2 + 2 * 2 * out_features * (k // group_size)
    raise ValueError(f"weight_dtype={weight_dtype!r} is not one of {WEIGHT_DTYPES}")


class QuantizedLinear(nn.Module):
    """The base of the per-format layers: input scale, bias, plug-in matmul and forward's dispatch.
    Build one with `QuantizedLinear.from_float(...)` (or a subclass directly)."""

    weight_dtype: str               # each format's name, one of WEIGHT_DTYPES
    group_size: int | None = None   # int4's group of input channels (None: one scale per output channel)
    pad = 0                         # zero input columns appended (int4: up to a multiple of group_size)
    path: str                       # "cpu" / "int8pack" / "int4pack" / "triton" / "dequant", set at construction

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "weight_dtype" in cls.__dict__:
            _FORMATS[cls.weight_dtype] = cls

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_dtype: str = "int8",
                   group_size: int = 128, fast: bool = True, input_scale: torch.Tensor | None = None,
                   quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> QuantizedLinear:
        """The layer of `weight_dtype` for a float weight [out_features, in_features] (not kept).
        group_size and quantized= are int4's (Int4Linear); fast=False keeps the "dequant" path."""
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={weight_dtype!r} is not one of {WEIGHT_DTYPES}")
        if weight_dtype != "int4":
            if quantized is not None:
                raise ValueError(f"quantized= takes int4 (q, scale, zero); weight_dtype={weight_dtype!r} quantizes itself")
            return _FORMATS[weight_dtype](weight, bias, fast=fast, input_scale=input_scale)
        return _FORMATS["int4"](weight, bias, group_size, fast=fast, input_scale=input_scale, quantized=quantized)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        if getattr(type(self), "weight_dtype", None) is None:
            raise TypeError(f"{type(self).__name__} is a base class: build a layer with QuantizedLinear.from_float")
        self.out_features, self.in_features = weight.shape
        self.act_dtype = weight.dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("inv_input_scale", None)
        if input_scale is not None:
            self.inv_input_scale = (1.0 / input_scale.detach().float().to(weight.device)).to(weight.dtype)

    @staticmethod
    def float_weight(weight: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
        """What a subclass quantizes: weight in fp32, row-major (the packers read raw memory), times
        input_scale along the input channels when given."""
        w = weight.detach().float().contiguous()
        if input_scale is not None:
            w = w * input_scale.detach().float().to(w.device)[None, :]
        return w

    @staticmethod
    def gpu_path(fast: bool, weight: torch.Tensor) -> str:
        """"triton" for a CUDA weight with fast=True, else "dequant"."""
        return "triton" if fast and weight.device.type == "cuda" else "dequant"

    # ------------------------------------------------------------ the matrix
    @torch.no_grad()
    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `ids` of the matrix this layer multiplies by, [*ids.shape, in_features]: exactly
        dequantized_weight()[ids], dequantizing only those rows. An embedding tied to this layer
        (a quantized lm_head) is looked up here, so the model keeps one copy of the matrix."""
        if self.inv_input_scale is not None:
            raise ValueError("rows() needs a layer without input_scale: its stored matrix is W * input_scale")
        w = self._rows(ids.reshape(-1), dtype or self.act_dtype)
        return w.reshape(*ids.shape, self.in_features)

    # ------------------------------------------------------------ plain layouts
    def int8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale fp32 [N]): W = q * scale[:, None] (minillm/quant/int8.py). Int8Linear only."""
        raise ValueError(f"int8_parts() needs weight_dtype='int8', this layer has {self.weight_dtype!r}")

    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed uint8 [N, Kp/2], scale fp32 [N, Kp/g], zero fp32 [N, Kp/g]) (minillm/quant/int4.py).
        Int4Linear only."""
        raise ValueError(f"int4_parts() needs weight_dtype='int4', this layer has {self.weight_dtype!r}")

    def quantized_bytes(self) -> int:
        """Bytes of the stored weight: quantized values + scales (+ zeros) (+ bias) (+ input scale)."""
        total = quantized_matrix_bytes(self.out_features, self.in_features, self.weight_dtype, self.group_size)
        if self.bias is not None:
            total += self.bias.numel() * self.bias.element_size()
        if self.inv_input_scale is not None:
            total += self.inv_input_scale.numel() * self.inv_input_scale.element_size()
        return total

    # ------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, matmul=None) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]; `matmul`: a plugged y = matmul(x2d, self) instead of the path."""
        if self.inv_input_scale is not None:
            x = x * self.inv_input_scale
        shape = x.shape[:-1]
        if matmul is None and self.path == "dequant":
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        x2d = x.reshape(-1, self.in_features)
        if matmul is None:
            y = self.own_matmul(x2d)
        else:
            y = matmul(x2d, self)
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != (x2d.shape[0], self.out_features):
                got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise ValueError(f"the plugged quantized matmul returned {got} for a {self.weight_dtype} layer "
                                 f"[{self.out_features}, {self.in_features}]; expected a tensor of shape "
                                 f"(rows of x, out_features) = {(x2d.shape[0], self.out_features)}")
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape, self.out_features)

    def own_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        """y = x2d W^T on this layer's own path (x2d [M, in_features] after the input_scale division; no bias):
        what forward runs when no matmul is plugged in."""
        if self.path == "dequant":
            return F.linear(x2d, self.dequantized_weight(x2d.dtype))
        if self.path == "triton":
            return self._triton_matmul(x2d if x2d.stride(-1) == 1 else x2d.contiguous())
        return self._cpu_matmul(x2d).to(x2d.dtype)   # the format's CPU kernel

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight_dtype}{group}, path={self.path}")


class ChannelLinear(QuantizedLinear):
    """The per-output-channel formats (int8, fp8): q [N, K] and scale [N], W = q * scale[:, None].
    Each sets quantize / dequantize (its quant/<format>.py functions) and may override choose_path."""

    quantize: staticmethod     # w [N, K] fp32 -> (q [N, K], scale fp32 [N])
    dequantize: staticmethod   # (q, scale, dtype) -> W [N, K]

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, fast: bool = True,
                 input_scale: torch.Tensor | None = None):
        super().__init__(weight, bias, input_scale)
        q, scale = self.quantize(self.float_weight(weight, input_scale))
        self.path = self.choose_path(fast, weight)
        self.register_buffer("q", q)
        if self.path.endswith("pack"):   # the CPU kernels take bf16 scales
            scale = scale.to(torch.bfloat16)
        self.register_buffer("scale", scale)

    def choose_path(self, fast: bool, weight: torch.Tensor) -> str:
        return self.gpu_path(fast, weight)

    @torch.no_grad()
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [out_features, in_features] matrix this layer multiplies by (input_scale folded in
        when given: it multiplies x / input_scale)."""
        return self.dequantize(self.q, self.scale, dtype or self.act_dtype)

    def _rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(self.q[ids], self.scale[ids], dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights as stored: float parameters (each tensor once) plus every
    QuantizedLinear's quantized values, scales and zeros."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.quantized_bytes()
            if module.bias is not None:
                seen.add(module.bias.data_ptr())
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
