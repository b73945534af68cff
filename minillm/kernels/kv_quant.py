"""KV cache quantization (`kv_dtype="int8"` or `"fp8"`): one scale per token and KV head.

A token's head vector x (head_dim values) is stored as

    scale = max|x| / QMAX          (QMAX = 127 for int8, 448 for e4m3, the largest finite value)
    q     = round(x / scale)       (int8: round half away from zero; fp8: the cast rounds to nearest)
    x    ~= q * scale              (dequantized by whoever reads the cache)

`quantize_kv` / `dequantize_kv` are the torch reference; the Triton store kernel (store_kv.py) and the
CPU kernels compute the same bits, and the attention kernels dequantize in registers. It lives beside
the kernels, the lowest floor that uses it; the pools themselves live in engine/kv_cache.py.
"""

from __future__ import annotations

import torch

from ..config import KV_DTYPES  # noqa: F401  ("int8", "fp8"; or None / "auto": the model dtype)
KV_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
KV_QMAX = {"int8": 127.0, "fp8": 448.0}
KV_SCALE_DTYPE = torch.float32  # one fp32 scale per token and KV head, for K and for V
# Floor of max|x| before taking 1/max: an all-zero vector gets scale 0 and stores 0s, not NaNs.
AMAX_FLOOR = 1e-30


def kv_quantized(kv_dtype: str | None) -> bool:
    return kv_dtype not in (None, "auto")


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] (any float dtype) -> (q [..., head_dim] int8 / float8_e4m3fn, scale [...] fp32).

    Symmetric absmax over the last dimension. The arithmetic is the Triton store kernel's, op for
    op (fp32 max, one reciprocal, a multiply, clamp, round), so both write the same bits."""
    qmax = KV_QMAX[kv_dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1).double()
    # The two divisions in fp64, then rounded: IEEE fp32 division, as the kernel computes it
    # (torch's fp32 `127 / tensor` on the CPU can be an ulp off, which flips rounding ties).
    scale = (amax / qmax).float()
    inv = (qmax / amax.clamp(min=AMAX_FLOOR)).float()
    y = (xf * inv.unsqueeze(-1)).clamp(-qmax, qmax)
    if kv_dtype == "int8":
        q = torch.where(y >= 0, y + 0.5, y - 0.5).trunc().to(torch.int8)   # round half away from zero
    else:
        q = y.to(torch.float8_e4m3fn)                                      # round to nearest even
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [..., head_dim] int8 / fp8, scale: [...] -> q * scale in `dtype` (computed in fp32)."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
