"""QuantizedLinear: y = x W^T (+ b) with W stored in int8 / int4 / fp8, and the fastest path
this machine has for it.

Paths (chosen at construction, named in `.path`):

- "int8pack" int8 on the CPU: `aten._weight_int8pack_mm` with bf16 activations and bf16
             scales (weight-only: activations stay floating point; needs in_features % 16 == 0:
             on an AVX-512 CPU, torch 2.13's kernel crashed or returned garbage for K = 200,
             measured). With fp32 activations the
             same op takes a scalar path about 10x slower than fp32 F.linear; with bf16 it
             streams the int8 matrix. (Tried and dropped: fbgemm's dynamic int8 GEMM,
             `quantized.linear_dynamic`: fast, but it also quantizes the activations per tensor
             to 7 bits, and SmolLM2's outlier channels then cost the top-1 token on 5 of 6 prompts.)
- "int4pack" int4 on the CPU: `aten._weight_int4pack_mm_for_cpu` (bf16 activations; needs
             out_features % 16 == 0), weights stay 4-bit in memory.
- "triton"   on CUDA GPUs: int8 and int4 everywhere, fp8 on sm_90+ (minillm/kernels/quant_matmul.py):
             the weights stay in their stored format and each kernel dequantizes its tile in
             registers (a split-K GEMV for up to 16 rows of x, a tl.dot GEMM above). It stores
             the same buffers as "dequant" (tests flip `.path` to run it under the interpreter).
- "dequant"  everything else (fp8 on the CPU and below sm_90, fast=False, odd shapes):
             dequantize the whole matrix to the activation dtype at each call, then F.linear.
             Correct, and the reference, but it reads and writes a float copy per call: slow.

Scales (and int4's zeros) are stored in bfloat16 on the CPU fast paths (what the kernels take),
in fp32 otherwise. `dequantized_weight()` returns the matrix every path multiplies by, so tests
compare each fast path against F.linear with it (the fast paths round activations to bf16).

Plain layouts and a plug-in hook (what a lab's or a Triton kernel needs, whatever the path):
`int4_parts()` -> (packed uint8 [N, Kp/2], scale fp32 [N, Kp/g], zero fp32 [N, Kp/g]) in
minillm/quant/int4.py's format (Kp = in_features padded to the group size; recovered exactly and
cached for "int4pack", whose packed format is the kernel's own); `int8_parts()` -> (q int8 [N, K],
scale fp32 [N]). `set_matmul(fn)` makes forward compute y = fn(x2d, layer) (x2d [M, K] in the
activation dtype, after the input_scale division; bias added after); `set_matmul(None)` restores
the path.

Rows: `rows(ids)` -> dequantized_weight()[ids], dequantizing only those rows (int4 rows gathered
straight from the "int4pack" layout); a tied embedding is looked up there. `quantized=(q, scale,
zero)` stores int4 levels computed elsewhere (GPTQ, minillm/quant/gptq.py) as given.

Activation-aware hook: `input_scale` [K] (e.g. from an AWQ-style search on calibration text)
quantizes W * input_scale and multiplies x by 1 / input_scale first, so y is unchanged in exact
arithmetic while salient input channels get finer quantization levels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..hardware import gpu_capability, missing_gpu_feature
from .fp8 import dequantize_fp8, quantize_fp8
from .int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from .int8 import dequantize_int8, quantize_int8

WEIGHT_DTYPES = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128)


def _int4pack_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


# "int4pack" layout (aten._convert_weight_to_int4pack_for_cpu, innerKTiles=1), as torch's
# int4mm_kernel.cpp packs it: rows in blocks of BLOCK_N (32 on AVX2 builds and CPUs, 64 on AVX-512);
# a full block's bytes are [K, BLOCK_N/2], byte (k, j) holding row j's level in its low nibble and
# row j + BLOCK_N/2's in its high nibble. A last block of fewer rows (N % BLOCK_N of them) is
# [K, rows/2] with rows 2i and 2i + 1 in byte i. rows() gathers from it directly; _int4pack_block_n
# probes which BLOCK_N this build and CPU pack with (0: neither, so rows() uses the plain layout).
INT4PACK_BLOCK_NS = (32, 64)
_BLOCK_N: list[int] = []


def _int4pack_gather(packed: torch.Tensor, ids: torch.Tensor, k: int, block_n: int) -> torch.Tensor:
    """Levels q uint8 [T, k] of rows ids from an "int4pack" buffer [N, k/2] packed in blocks of block_n."""
    n = packed.shape[0]
    flat = packed.reshape(-1)
    full = n // block_n * block_n                                   # rows in full blocks
    half, tail = block_n // 2, n - full
    kk = torch.arange(k)
    j = ids % block_n
    in_block = (ids // block_n * (k * half) + (j % half))[:, None] + kk * half           # [T, K]
    r = (ids - full).clamp(min=0)
    in_tail = (full * k // 2 + r // 2)[:, None] + kk * max(tail // 2, 1)                  # [T, K]
    is_tail = (ids >= full)[:, None]
    byte = flat[torch.where(is_tail, in_tail, in_block)]
    shift = torch.where(ids >= full, 4 * (r % 2), 4 * (j // half)).to(torch.uint8)
    return (byte >> shift[:, None]) & 0x0F


def _int4pack_block_n() -> int:
    """The row block (32 or 64) this torch build's int4 CPU packing uses on this CPU, checked by
    packing random levels (full blocks and a short last block) and gathering them back; 0 if the
    layout is neither (probed once)."""
    if not _BLOCK_N:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (176, 64), generator=g, dtype=torch.int32)  # 5 x 32 + 16 and 2 x 64 + 48
        ids = torch.arange(q.shape[0])
        found = 0
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            if tuple(packed.shape) == (q.shape[0], 32):
                found = next((b for b in INT4PACK_BLOCK_NS
                              if torch.equal(_int4pack_gather(packed, ids, 64, b).int(), q)), 0)
        except (RuntimeError, AttributeError):
            pass
        _BLOCK_N.append(found)
    return _BLOCK_N[0]


class QuantizedLinear(nn.Module):
    """Built from a float weight [out_features, in_features] (the weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_dtype: str = "int8",
                 group_size: int = 128, fast: bool = True, input_scale: torch.Tensor | None = None,
                 quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={weight_dtype!r} is not one of {WEIGHT_DTYPES}")
        if weight_dtype == "int4" and group_size not in GROUP_SIZES:
            raise ValueError(f"weight_group_size={group_size!r} is not one of {GROUP_SIZES}")
        self.out_features, self.in_features = weight.shape
        self.weight_dtype, self.group_size = weight_dtype, group_size
        self.act_dtype = weight.dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("inv_input_scale", None)
        w = weight.detach().float().contiguous()  # row-major: the packers read raw memory
        if input_scale is not None:
            s = input_scale.detach().float().to(w.device)
            w = w * s[None, :]
            self.inv_input_scale = (1.0 / s).to(weight.dtype)
        if quantized is not None and weight_dtype != "int4":
            raise ValueError(f"quantized= takes int4 (q, scale, zero); weight_dtype={weight_dtype!r} quantizes itself")
        on_cpu = weight.device.type == "cpu"
        on_gpu = fast and weight.device.type == "cuda"
        self.pad = 0
        self.matmul_fn = None  # set_matmul: a plug-in y = fn(x2d, layer) replacing the path
        self._int4_cache = None  # int4pack: the plain layout, recovered once (int4_parts)
        if weight_dtype == "int8":
            q, scale = quantize_int8(w)
            self.register_buffer("q", q)
            if fast and on_cpu and hasattr(torch, "_weight_int8pack_mm") and self.in_features % 16 == 0:
                self.path = "int8pack"
                self.register_buffer("scale", scale.to(torch.bfloat16))
            else:
                self.path = "triton" if on_gpu else "dequant"
                self.register_buffer("scale", scale)
        elif weight_dtype == "int4":
            self.pad = (-self.in_features) % group_size  # zero columns meet zero activations
            if quantized is not None:  # already on the int4 grid (e.g. GPTQ): stored as given
                q, scale, zero = (t.to(w.device) for t in self._check_quantized(quantized))
            else:
                if self.pad:
                    w = F.pad(w, (0, self.pad))
                q, scale, zero = quantize_int4(w, group_size)
            scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
            if fast and on_cpu and _int4pack_available() and self.out_features % 16 == 0:
                self.path = "int4pack"
                # The kernel computes (q - 8) * scale + zero8, so zero8 = zero + 8 * scale.
                zero8 = (zero.float() + 8 * scale.float()).to(torch.bfloat16)
                self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
                self.register_buffer("scales_and_zeros", torch.stack([scale, zero8], dim=-1).transpose(0, 1).contiguous())
            else:
                self.path = "triton" if on_gpu else "dequant"
                self.register_buffer("packed", pack_int4(q))
                self.register_buffer("scale", scale)
                self.register_buffer("zero", zero)
        else:
            q, scale = quantize_fp8(w)
            fp8_gpu = on_gpu and missing_gpu_feature(gpu_capability(weight.device), "fp8_matmul") is None
            self.path = "triton" if fp8_gpu else "dequant"
            self.register_buffer("q", q)
            self.register_buffer("scale", scale)

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

    # ------------------------------------------------------------ the matrix
    @torch.no_grad()
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [out_features, in_features] matrix this layer multiplies by (input_scale folded in
        when given: it multiplies x / input_scale)."""
        dtype = dtype or self.act_dtype
        if self.weight_dtype == "int8":
            return dequantize_int8(self.q, self.scale, dtype)
        if self.weight_dtype == "fp8":
            return dequantize_fp8(self.q, self.scale, dtype)
        packed, scale, zero = self.int4_parts()
        return dequantize_int4(unpack_int4(packed), scale, zero)[:, : self.in_features].to(dtype)

    @torch.no_grad()
    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `ids` of the matrix this layer multiplies by, [*ids.shape, in_features]: exactly
        dequantized_weight()[ids], dequantizing only those rows. An embedding tied to this layer
        (a quantized lm_head) is looked up here, so the model keeps one copy of the matrix.
        Works on every path: int8 / fp8 rows are q[ids] * scale[ids]; int4 rows are gathered from
        the plain layout ("dequant", "triton") or from the CPU kernel's own layout ("int4pack")."""
        if self.inv_input_scale is not None:
            raise ValueError("rows() needs a layer without input_scale: its stored matrix is W * input_scale")
        dtype = dtype or self.act_dtype
        flat = ids.reshape(-1)
        if self.weight_dtype == "int8":
            w = dequantize_int8(self.q[flat], self.scale[flat], dtype)
        elif self.weight_dtype == "fp8":
            w = dequantize_fp8(self.q[flat], self.scale[flat], dtype)
        else:
            if self.path != "int4pack":
                q, scale, zero = unpack_int4(self.packed[flat]), self.scale[flat].float(), self.zero[flat].float()
            elif self._int4_cache is None and (block_n := _int4pack_block_n()):
                q = _int4pack_gather(self.packed, flat, self.in_features + self.pad, block_n)
                sz = self.scales_and_zeros[:, flat].float()  # [K/g, T, 2]
                scale = sz[..., 0].t()
                zero = sz[..., 1].t() - 8 * scale  # as _recover_int4 computes the plain zero
            else:  # a layout this torch build does not document: the recovered plain layout
                packed, scale, zero = self.int4_parts()
                q, scale, zero = unpack_int4(packed[flat]), scale[flat], zero[flat]
            w = dequantize_int4(q, scale, zero)[:, : self.in_features].to(dtype)
        return w.reshape(*ids.shape, self.in_features)

    # ------------------------------------------------------------ plain layouts
    @torch.no_grad()
    def int8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale fp32 [N]): W = q * scale[:, None] (minillm/quant/int8.py)."""
        if self.weight_dtype != "int8":
            raise ValueError(f"int8_parts() needs weight_dtype='int8', this layer has {self.weight_dtype!r}")
        return self.q, self.scale.float()

    @torch.no_grad()
    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed uint8 [N, Kp/2], scale fp32 [N, Kp/g], zero fp32 [N, Kp/g]), pack_int4's format
        (Kp = in_features + pad, a multiple of group_size g): W = dequantize_int4(unpack_int4(packed),
        scale, zero)[:, :in_features], exactly the matrix dequantized_weight() returns."""
        if self.weight_dtype != "int4":
            raise ValueError(f"int4_parts() needs weight_dtype='int4', this layer has {self.weight_dtype!r}")
        if self.path != "int4pack":
            return self.packed, self.scale.float(), self.zero.float()
        if self._int4_cache is None:
            self._int4_cache = self._recover_int4()
        return self._int4_cache

    def _recover_int4(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The plain layout of an "int4pack" layer, from its stored data alone. The CPU kernel computes
        w = (q - 8) * scale + zero8 in fp32 (fp32 scales and zeros give fp32 results), so multiplying
        the identity returns each w in fp32, and q = round((w - zero8) / scale) + 8 is exact (|w - zero8|
        / scale <= 8, far inside fp32's precision). The plain zero is zero8 - 8 * scale (in fp32)."""
        k, g = self.in_features + self.pad, self.group_size
        sz = self.scales_and_zeros.float()  # [K/g, N, 2]
        scale = sz[..., 0].t().contiguous()  # [N, K/g]
        zero8 = sz[..., 1].t().contiguous()  # [N, K/g]
        q = torch.empty(self.out_features, k, dtype=torch.uint8)
        chunk = max(g, (1 << 22) // max(k, 1) // g * g)  # identity blocks of at most ~4M entries
        for start in range(0, k, chunk):
            stop = min(k, start + chunk)
            eye = torch.zeros(stop - start, k)
            eye[:, start:stop] = torch.eye(stop - start)
            w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, g, sz).t()  # [N, stop - start]
            groups = torch.arange(start, stop) // g
            level = torch.round((w - zero8[:, groups]) / scale[:, groups]) + 8
            q[:, start:stop] = level.clamp_(0, 15).to(torch.uint8)
        return pack_int4(q), scale, zero8 - 8 * scale

    def set_matmul(self, fn) -> None:
        """Plug in y = fn(x2d, layer) (x2d [M, in_features] in the activation dtype, after the
        input_scale division; returns [M, out_features]; the bias is added after). None restores
        the layer's own path."""
        if fn is not None and not callable(fn):
            raise ValueError(f"set_matmul takes a callable fn(x2d, layer) or None, got {type(fn).__name__}")
        self.matmul_fn = fn

    def quantized_bytes(self) -> int:
        """Bytes of the stored weight: quantized values + scales (+ zeros) (+ bias)."""
        n, k = self.out_features, self.in_features + self.pad
        if self.weight_dtype in ("int8", "fp8"):
            total = n * k + 4 * n
        else:
            total = n * k // 2 + 2 * 2 * n * (k // self.group_size)
        if self.bias is not None:
            total += self.bias.numel() * self.bias.element_size()
        if self.inv_input_scale is not None:
            total += self.inv_input_scale.numel() * self.inv_input_scale.element_size()
        return total

    # ------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inv_input_scale is not None:
            x = x * self.inv_input_scale
        shape = x.shape[:-1]
        if self.matmul_fn is not None:
            y = self.matmul_fn(x.reshape(-1, self.in_features), self).to(x.dtype)
        elif self.path == "int8pack":
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.q,
                                          self.scale).to(x.dtype)
        elif self.path == "triton":
            from ..kernels import quant_matmul  # imported late: the interpreter is chosen before triton is imported

            x2d = x.reshape(-1, self.in_features)
            if x2d.stride(-1) != 1:
                x2d = x2d.contiguous()
            if self.weight_dtype == "int8":
                y = quant_matmul.int8_matmul(x2d, self.q, self.scale)
            elif self.weight_dtype == "int4":
                y = quant_matmul.int4_matmul(x2d, self.packed, self.scale, self.zero, self.group_size)
            else:
                y = quant_matmul.fp8_matmul(x2d, self.q, self.scale)
        elif self.path == "int4pack":
            xb = x.reshape(-1, self.in_features).to(torch.bfloat16)
            if self.pad:
                xb = F.pad(xb, (0, self.pad))
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size,
                                                          self.scales_and_zeros).to(x.dtype)
        else:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape, self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.weight_dtype == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight_dtype}{group}, path={self.path}")


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
