"""Fused RMSNorm (optionally with the residual add before it): kernel, launcher, reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(
    x_ptr,          # [num_tokens, hidden] input (row stride stride_x)
    residual_ptr,   # [num_tokens, hidden] residual, updated in place to x + residual (if HAS_RESIDUAL)
    weight_ptr,     # [hidden]
    out_ptr,        # [num_tokens, hidden]
    stride_x, stride_r, stride_o,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # Normalise the sum as stored (rounded to the model dtype), as the unfused `x + r` then norm does.
        x = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / hidden
    # Round the normalised row to the model dtype before the weight, like Llama's reference
    # (`weight * x.to(dtype)`); a no-op for fp32.
    y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, hidden]; weight: [hidden]. With `residual`, it becomes x + residual first."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm wants x [T, H] and weight [H]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1)):
        raise ValueError("rmsnorm needs rows with unit stride (call .contiguous()) and residual shaped like x")
    out = torch.empty_like(x)
    hidden = x.shape[1]
    block = triton.next_power_of_2(hidden)
    res = residual if residual is not None else x
    rmsnorm_kernel[(x.shape[0],)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
    )
    return out


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        x = x + residual
        residual.copy_(x)
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y.float() * weight.float()).to(x.dtype)
