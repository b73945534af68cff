"""Fused SiLU-and-multiply (the SwiGLU gate of the Llama MLP): kernel, launcher, reference.

gate_up [T, 2 * I] holds the gate projection in its first I columns and the up projection in
the last I; the result is silu(gate) * up [T, I], computed in fp32 and rounded once. Fusing
saves writing silu(gate) to memory and reading it back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024      # columns per program; I needs no particular size (the tail is masked)
SILU_NUM_WARPS = 4


@triton.jit
def silu_and_mul_kernel(
    gate_up_ptr,   # [num_tokens, 2 * intermediate] (row stride stride_in), unit stride along columns
    out_ptr,       # [num_tokens, intermediate] (row stride stride_out)
    stride_in, stride_out,
    intermediate,
    BLOCK: tl.constexpr,  # columns per program (a power of 2)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    src = gate_up_ptr + row * stride_in + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + intermediate, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up   # silu(g) = g * sigmoid(g); exp(-g) = inf gives -0, not NaN
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [T, 2 * I] -> silu(gate_up[:, :I]) * gate_up[:, I:]: [T, I] (into `out` if given)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_and_mul wants gate_up [num_tokens, 2 * intermediate] with unit column stride; "
                         f"got {tuple(gate_up.shape)} strides {gate_up.stride()}")
    if gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"silu_and_mul wants fp32/bf16/fp16; got {gate_up.dtype}")
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (num_tokens, intermediate) or out.dtype != gate_up.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {intermediate}] {gate_up.dtype} with unit column stride; "
                         f"got {tuple(out.shape)} {out.dtype}")
    if num_tokens == 0 or intermediate == 0:
        return out
    silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, SILU_BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), intermediate, BLOCK=SILU_BLOCK, num_warps=SILU_NUM_WARPS,
    )
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
