"""The split-K GEMVs' last step: add the fp32 partial sums of K's slices, round once to x's dtype.

A low-bit GEMV with few rows cuts K into split_k slices (quant_launch.choose_split_k) so the grid
fills the GPU; each slice writes fp32 partial sums [split_k, M, N], and `split_k_reduce_kernel` adds
them up in slice order and rounds once to x's dtype (deterministic, no atomics; one extra small
launch). With one slice (wide layers such as gate_up or the head) the GEMV writes the output in
x's dtype itself, and nothing is reduced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

REDUCE_BLOCK = 1024
REDUCE_NUM_WARPS = 4


@triton.jit
def split_k_reduce_kernel(
    partial_ptr,  # [split_k, M, N] fp32 partial sums of a GEMV, contiguous (split stride M * N, row stride N)
    out_ptr,      # [M, N] in x's dtype (row stride stride_om, unit column stride)
    M, N, split_k,
    stride_om,
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    src = partial_ptr + row * N + cols
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(0, split_k):   # slices in order: deterministic
        acc += tl.load(src, mask=mask, other=0.0)
        src += M * N              # the next slice
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_k_target(out: torch.Tensor, split: int) -> tuple[torch.Tensor, int, int]:
    """(tensor the GEMV writes, its split stride, its row stride): `out` itself for one slice,
    else fresh fp32 partial sums [split, M, N]."""
    if split == 1:
        return out, 0, out.stride(0)
    m, n = out.shape
    partial = torch.empty(split, m, n, dtype=torch.float32, device=out.device)
    return partial, partial.stride(0), partial.stride(1)


def split_k_reduce(target: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` [M, N] = the sum over slices of target [split, M, N] (fp32, contiguous), rounded to out's
    dtype; nothing to do when the GEMV wrote `out` itself (target is out: one slice)."""
    if target is not out:  # [split, M, N] fp32 -> out
        m, n = out.shape
        if target.dtype != torch.float32 or target.shape[1:] != (m, n) or not target.is_contiguous():
            raise ValueError(f"split_k_reduce: partial sums must be contiguous fp32 [split, {m}, {n}], "
                             f"got {tuple(target.shape)} {target.dtype}")
        if out.stride(1) != 1 and n > 1:
            raise ValueError(f"split_k_reduce: out needs unit column stride; strides {out.stride()}")
        split_k_reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](
            target, out, m, n, target.shape[0], out.stride(0), BLOCK=REDUCE_BLOCK, num_warps=REDUCE_NUM_WARPS)
    return out


def split_k_reduce_reference(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partial [split, M, N] fp32 -> their sum over the slices [M, N], rounded once to `dtype`."""
    return partial.float().sum(dim=0).to(dtype)
