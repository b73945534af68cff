"""Group-wise int4 weight matmuls y = x W^T, W = q * scale + zero per group: kernels, launchers, reference.

The weights stay packed in memory (what makes decode faster: it reads a quarter of fp16's bytes);
each program unpacks the tile it loaded and dequantizes it in registers, with fp32 sums. The plain
int4 layout (minillm/quant/int4.py, what QuantizedLinear.int4_parts() returns):

    W = q * scale[n, k // g] + zero[n, k // g], q packed two per byte
    (pack_int4: byte j of a row holds q[2j] in its low nibble and q[2j + 1] in its high nibble),
    packed uint8 [N, Kp / 2], scale / zero [N, Kp / g], Kp = K rounded up to the group size g

`int4_gemv_kernel` runs decode batches (M <= GEMV_MAX_M, split-K: quant_launch.py,
split_k_reduce.py) with W in fp32; `int4_gemm_kernel` runs prefill through `tl.dot`: the weight
tile is dequantized to x's dtype (q * scale + zero rounds once, as dequantize_int4 to that dtype
does) and multiplied on the tensor cores; fp32 activations use exact fp32 dots. It splits each K
tile into its even and odd columns (the low and high nibbles): two dots of BLOCK_K / 2. The padded
weight columns past K meet masked, zero activations. `int4_matmul` chooses between them by M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_decode import dot_in_fp32
from .quant_launch import (GEMM_LAUNCH, GEMV_MAX_M, GEMV_NUM_WARPS, check_out, check_scale, check_split, check_x,
                           choose_split_k, gemv_blocks, sm_count)
from .split_k_reduce import split_k_reduce, split_k_target


# ============================================================== kernels
@triton.jit
def int4_gemv_kernel(
    x_ptr,        # [M, K] activations fp32 / bf16 / fp16 (row stride stride_xm, unit stride along K)
    packed_ptr,   # [N, Kp / 2] uint8, two 4-bit levels a byte, low nibble = even column (row stride stride_pn)
    scale_ptr,    # [N, Kp / group_size] group scales (row stride stride_sn; fp32 / bf16 / fp16)
    zero_ptr,     # [N, Kp / group_size] group zeros (the group minimum), same strides as scale
    out_ptr,      # [split_k, M, N] fp32 partial sums, or [M, N] in x's dtype when split_k == 1
                  # (strides stride_os, stride_om, 1)
    M, N, K,      # K: x's columns (<= Kp; the padded weight columns meet masked, zero activations)
    Kp,           # padded K: 2 * packed columns, a multiple of group_size
    group_size,   # even, so columns 2j and 2j + 1 (one byte) always share a group
    stride_xm, stride_pn, stride_sn, stride_os, stride_om,
    k_per_split,  # columns of Kp per split (a multiple of BLOCK_K)
    BLOCK_M: tl.constexpr,  # M rounded up to a power of 2
    BLOCK_N: tl.constexpr,  # output channels per program
    BLOCK_K: tl.constexpr,  # (unpacked) K columns per loop step: BLOCK_K / 2 bytes per row
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, Kp)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm        # [BLOCK_M, 1]
    p_rows = packed_ptr + cols.to(tl.int64)[:, None] * stride_pn    # [BLOCK_N, 1]
    s_rows = scale_ptr + cols.to(tl.int64)[:, None] * stride_sn     # [BLOCK_N, 1]
    z_rows = zero_ptr + cols.to(tl.int64)[:, None] * stride_sn      # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)    # packed (byte) columns
        even = 2 * half                                # the low nibble's column; the high one is even + 1
        w_mask = col_mask[:, None] & (even < k_end)[None, :]
        p = tl.load(p_rows + half[None, :], mask=w_mask, other=0)          # [BLOCK_N, BLOCK_K / 2] uint8
        group = (even // group_size)[None, :]
        s = tl.load(s_rows + group, mask=w_mask, other=0).to(tl.float32)   # [BLOCK_N, BLOCK_K / 2]
        z = tl.load(z_rows + group, mask=w_mask, other=0).to(tl.float32)   # [BLOCK_N, BLOCK_K / 2]
        w_even = (p & 0xF).to(tl.float32) * s + z
        w_odd = (p >> 4).to(tl.float32) * s + z
        x_even = tl.load(x_rows + even[None, :], mask=row_mask[:, None] & (even < K)[None, :],
                         other=0).to(tl.float32)                           # [BLOCK_M, BLOCK_K / 2]
        x_odd = tl.load(x_rows + even[None, :] + 1, mask=row_mask[:, None] & (even + 1 < K)[None, :],
                        other=0).to(tl.float32)                            # [BLOCK_M, BLOCK_K / 2]
        acc += tl.sum(x_even[:, None, :] * w_even[None, :, :] + x_odd[:, None, :] * w_odd[None, :, :], axis=2)
    out = out_ptr + pid_k.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def int4_gemm_kernel(
    x_ptr,        # [M, K] activations fp32 / bf16 / fp16 (row stride stride_xm, unit stride along K)
    packed_ptr,   # [N, Kp / 2] uint8, low nibble = even column (row stride stride_pn)
    scale_ptr,    # [N, Kp / group_size] group scales (row stride stride_sn)
    zero_ptr,     # [N, Kp / group_size] group zeros, same strides as scale
    out_ptr,      # [M, N] in x's dtype (row stride stride_om)
    M, N, K, Kp, group_size,
    stride_xm, stride_pn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr,      # rows of x per program (>= 16)
    BLOCK_N: tl.constexpr,      # output channels per program (>= 16)
    BLOCK_K: tl.constexpr,      # unpacked K columns per step: two dots of BLOCK_K / 2 (>= 16 each)
    DOT_IN_FP32: tl.constexpr,  # exact fp32 dots (fp32 activations; bf16 under the interpreter)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm        # [BLOCK_M, 1]
    p_rows = packed_ptr + cols.to(tl.int64)[:, None] * stride_pn    # [BLOCK_N, 1]
    s_rows = scale_ptr + cols.to(tl.int64)[:, None] * stride_sn     # [BLOCK_N, 1]
    z_rows = zero_ptr + cols.to(tl.int64)[:, None] * stride_sn      # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, Kp, BLOCK_K):
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)    # packed (byte) columns
        even = 2 * half
        w_mask = col_mask[:, None] & (even < Kp)[None, :]
        p = tl.load(p_rows + half[None, :], mask=w_mask, other=0)          # [BLOCK_N, BLOCK_K / 2] uint8
        group = (even // group_size)[None, :]
        s = tl.load(s_rows + group, mask=w_mask, other=0).to(tl.float32)   # [BLOCK_N, BLOCK_K / 2]
        z = tl.load(z_rows + group, mask=w_mask, other=0).to(tl.float32)
        x_even = tl.load(x_rows + even[None, :], mask=row_mask[:, None] & (even < K)[None, :],
                         other=0)                                          # [BLOCK_M, BLOCK_K / 2]
        x_odd = tl.load(x_rows + even[None, :] + 1, mask=row_mask[:, None] & (even + 1 < K)[None, :], other=0)
        w_even = (p & 0xF).to(tl.float32) * s + z                          # [BLOCK_N, BLOCK_K / 2] fp32
        w_odd = (p >> 4).to(tl.float32) * s + z
        if DOT_IN_FP32:
            # round the weights to x's dtype first, as dequantize_int4(..., dtype) does
            w_even = w_even.to(x_ptr.dtype.element_ty).to(tl.float32)
            w_odd = w_odd.to(x_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), input_precision="ieee")
        else:
            acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
            acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# ============================================================== launchers
def _int4_check(x, packed, scale, zero, group_size, who: str) -> int:
    """Checks the plain int4 layout; returns Kp (the padded K)."""
    if not isinstance(group_size, int) or group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"{who}: group_size={group_size!r} must be a power of two >= 32 (QuantizedLinear uses 32, 64, 128)")
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"{who}: packed must be [N, Kp / 2] uint8 (pack_int4), got {tuple(packed.shape)} {packed.dtype}")
    if packed.stride(1) != 1 and packed.shape[1] > 1:
        raise ValueError(f"{who}: packed needs unit stride along K; strides {packed.stride()}")
    n, kp = packed.shape[0], packed.shape[1] * 2
    if kp % group_size:
        raise ValueError(f"{who}: packed holds Kp={kp} columns, not a multiple of group_size={group_size}")
    if x.dim() != 2 or not kp - group_size < x.shape[1] <= kp:
        raise ValueError(f"{who}: x must be [M, K] with Kp - group_size < K <= Kp = {kp} "
                         f"(K padded to the group size), got shape {tuple(x.shape)}")
    check_x(x, x.shape[1], who)
    check_scale(scale, (n, kp // group_size), who, "scale")
    check_scale(zero, (n, kp // group_size), who, "zero")
    if zero.stride() != scale.stride():
        raise ValueError(f"{who}: scale and zero need the same strides; got {scale.stride()} and {zero.stride()}")
    return kp


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              split_k: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMV for int4 group-wise weights: x [M <= 16, K] -> x @ W^T [M, N] in x's dtype,
    W = dequantize_int4(unpack_int4(packed), scale, zero)[:, :K]."""
    kp = _int4_check(x, packed, scale, zero, group_size, "int4_gemv")
    check_split(split_k)
    m, k = x.shape
    n = packed.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"int4_gemv: x has M={m} rows; the GEMV takes 1..{GEMV_MAX_M} (use the GEMM)")
    block_m, block_n, block_k = gemv_blocks(m)
    if split_k is None:
        split, per = choose_split_k(n, kp, block_n, block_k, sm_count(x.device))
    else:
        steps = triton.cdiv(kp, block_k)
        per = triton.cdiv(steps, min(split_k, steps)) * block_k
        split = triton.cdiv(kp, per)
    out = check_out(out, x, n, "int4_gemv")
    target, stride_os, stride_om = split_k_target(out, split)
    int4_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, packed, scale, zero, target, m, n, k, kp, group_size, x.stride(0), packed.stride(0), scale.stride(0),
        stride_os, stride_om, per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=GEMV_NUM_WARPS)
    return split_k_reduce(target, out)


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM for int4 group-wise weights: x [M, K] -> x @ W^T [M, N] in x's dtype (W rounded to
    x's dtype first, as dequantize_int4(..., x.dtype) does)."""
    kp = _int4_check(x, packed, scale, zero, group_size, "int4_gemm")
    m, k = x.shape
    n = packed.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or (out.stride(1) != 1 and n > 1):
        raise ValueError(f"int4_gemm: out must be [{m}, {n}] {x.dtype} with unit column stride; "
                         f"got {tuple(out.shape)} {out.dtype}")
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = GEMM_LAUNCH[x.dtype]
    int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, packed, scale, zero, out, m, n, k, kp, group_size, x.stride(0), packed.stride(0), scale.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_IN_FP32=dot_in_fp32(x.dtype),
        num_warps=num_warps, num_stages=num_stages)
    return out


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W the plain int4 layout (packed uint8 [N, Kp / 2],
    scale / zero [N, Kp / group_size]): GEMV for M <= GEMV_MAX_M, GEMM above."""
    if x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_M:
        return int4_gemv(x, packed, scale, zero, group_size, out=out)
    return int4_gemm(x, packed, scale, zero, group_size, out=out)


# ============================================================== torch reference
def int4_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """x @ W^T, W = dequantize_int4(unpack_int4(packed), scale, zero)[:, :K] rounded to x's dtype
    (what the GEMM multiplies; the GEMV keeps W in fp32: within the same bound), fp32 sums."""
    low, high = packed & 0x0F, packed >> 4
    q = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)                # [N, Kp]
    n, kp = q.shape
    w = q.float().reshape(n, kp // group_size, group_size) * scale.float()[..., None] + zero.float()[..., None]
    w = w.reshape(n, kp)[:, : x.shape[1]].to(x.dtype).float()
    return (x.float() @ w.t()).to(x.dtype)
