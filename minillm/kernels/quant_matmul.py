"""Weight-only low-bit matmuls y = x W^T with W dequantized in registers: kernels, launchers,
references.

The weights stay in their stored format in memory (what makes decode faster: it reads fewer
bytes); each program converts the tile it loaded to floating point and multiplies there, with
fp32 sums. Three formats (minillm/quant):

- int8, per output channel:   W = q * scale[:, None]                   q int8 [N, K], scale [N]
- int4, group-wise asymmetric: W = q * scale[n, k // g] + zero[n, k // g], q packed two per byte
  (pack_int4: byte j of a row holds q[2j] in its low nibble and q[2j + 1] in its high nibble),
  packed uint8 [N, Kp / 2], scale / zero [N, Kp / g], Kp = K rounded up to the group size g
- fp8 e4m3, per output channel: W = float(q) * scale[:, None]          q float8_e4m3fn [N, K], scale [N]

Two kernels per format, chosen by the number of rows M of x:

1. GEMV (decode, M <= GEMV_MAX_M = 16): grid (cdiv(N, BLOCK_N), split_k). A program takes
   BLOCK_N output channels and one slice of K, all M rows at once: x [BLOCK_M, BLOCK_K] times
   W [BLOCK_N, BLOCK_K] as a broadcast product summed along K on the CUDA cores (no tl.dot: it
   would pad M to 16 rows). BLOCK_M = M rounded up to a power of 2, and BLOCK_N x BLOCK_K
   shrink as BLOCK_M grows so the product tile stays ~8K fp32 values (64 registers a thread at
   4 warps). Split-K: with a few rows, N / BLOCK_N programs would leave most SMs idle, so K is
   cut into slices (about 4 programs per SM in all); each slice writes fp32 partial sums
   [split_k, M, N] and `split_k_reduce_kernel` adds them up and rounds once to x's dtype
   (deterministic, no atomics; one extra small launch). With one slice (wide layers such as
   gate_up or the head) the GEMV writes the output in x's dtype itself.
2. GEMM (prefill, M > 16): grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)), tiles through `tl.dot`
   (BLOCK_M >= 16). The weight tile is dequantized in registers to x's dtype (int8 and e4m3 are
   exact in bf16 / fp16; int4's q * scale + zero rounds once, as dequantize_int4 to that dtype
   does) and multiplied on the tensor cores; fp32 activations use exact fp32 dots. int4 splits
   each K tile into its even and odd columns (the low and high nibbles): two dots of BLOCK_K / 2.

fp8 has a second GEMM mode, `fp8_matmul(..., fp8_activations=True)`: x is quantized per row
(token) to e4m3 with scale max|x[m]| / 448, and `tl.dot` takes both operands in fp8 (Hopper's
fp8 tensor cores; AOT compiles it for sm_90). It is W8A8, not weight-only: the
activations lose precision too, which is why QuantizedLinear does not use it by default.
fp8 kernels run on sm_90 (Hopper: fp8 conversions and tensor cores; Triton refuses e4m3 on
sm_80), the only fp8 target compiled ahead of time; QuantizedLinear keeps its dequantize
path elsewhere.

Every launcher checks shapes and dtypes and raises ValueError naming the value and what is
allowed. Kernels take element strides for rows; the K axis must be unit-stride.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..hardware import gpu_capability, missing_gpu_feature
from .paged_decode import dot_in_fp32

GEMV_MAX_M = 16           # x rows up to which the GEMV kernel runs (decode batches); more: the GEMM
GEMV_NUM_WARPS = 4
# GEMV tile (BLOCK_N, BLOCK_K) per BLOCK_M: BLOCK_M * BLOCK_N * BLOCK_K = 8192 fp32 products. int8 and
# fp8 rows read BLOCK_K bytes per row per step (>= 64: two 32-byte sectors), int4 rows BLOCK_K / 2.
GEMV_BLOCKS = {1: (32, 256), 2: (32, 128), 4: (16, 128), 8: (16, 64), 16: (8, 64)}
PROGRAMS_PER_SM = 4       # split-K target: about this many GEMV programs per SM
DEFAULT_SM_COUNT = 132    # H100 / H200, used where no GPU is visible (interpreter, AOT)
# GEMM launch (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per activation dtype. fp32 tiles
# take twice the registers and shared memory of 16-bit ones; int4's BLOCK_K / 2 must be >= 16.
GEMM_LAUNCH = {
    torch.float32: (32, 64, 32, 4, 2),
    torch.bfloat16: (64, 64, 64, 4, 3),
    torch.float16: (64, 64, 64, 4, 3),
}
FP8_MAX = 448.0           # largest finite e4m3 value
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ============================================================== kernels
@triton.jit
def channel_gemv_kernel(
    x_ptr,        # [M, K] activations fp32 / bf16 / fp16 (row stride stride_xm, unit stride along K)
    w_ptr,        # [N, K] int8 or float8_e4m3fn weights (row stride stride_wn, unit stride along K)
    scale_ptr,    # [N] per-output-channel scale (fp32 / bf16 / fp16)
    out_ptr,      # [split_k, M, N] fp32 partial sums, or [M, N] in x's dtype when split_k == 1
                  # (strides stride_os, stride_om, 1)
    M, N, K,
    stride_xm, stride_wn, stride_os, stride_om,
    k_per_split,  # K columns per split (a multiple of BLOCK_K); program (n, s) takes [s * k_per_split, ...)
    BLOCK_M: tl.constexpr,  # M rounded up to a power of 2 (rows past M are masked)
    BLOCK_N: tl.constexpr,  # output channels per program
    BLOCK_K: tl.constexpr,  # K columns per loop step
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm    # [BLOCK_M, 1]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn    # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        w_mask = col_mask[:, None] & k_mask[None, :]
        # no `other` for an fp8 load (the interpreter cannot cast it): masked lanes are zeroed after the cast
        w = tl.where(w_mask, tl.load(w_rows + ks[None, :], mask=w_mask).to(tl.float32), 0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0).to(tl.float32)
        # [BLOCK_M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K] summed along K -> [BLOCK_M, BLOCK_N]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0).to(tl.float32)   # [BLOCK_N]
    acc = acc * scale[None, :]   # one scale per output channel: applied once, after the sum
    out = out_ptr + pid_k.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


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


@triton.jit
def channel_gemm_kernel(
    x_ptr,        # [M, K] activations fp32 / bf16 / fp16, or e4m3 when FP8_ACT (row stride stride_xm, unit along K)
    x_scale_ptr,  # [M] fp32 per-row scale of x when FP8_ACT (x_real = x * x_scale[:, None]); unused otherwise
    w_ptr,        # [N, K] int8 or float8_e4m3fn weights (row stride stride_wn, unit stride along K)
    scale_ptr,    # [N] per-output-channel scale (fp32 / bf16 / fp16)
    out_ptr,      # [M, N] (row stride stride_om): x's dtype (the original activation dtype when FP8_ACT)
    M, N, K,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr,      # rows of x per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,      # output channels per program (>= 16)
    BLOCK_K: tl.constexpr,      # K columns per loop step (>= 16; >= 32 for fp8 dots)
    DOT_IN_FP32: tl.constexpr,  # exact fp32 dots: fp32 activations, and bf16 under the interpreter,
                                # whose tl.dot multiplies bf16's raw uint16 bits
    FP8_ACT: tl.constexpr,      # x is e4m3 too: tl.dot multiplies fp8 by fp8 (sm_90)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm    # [BLOCK_M, 1]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn    # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x_mask = row_mask[:, None] & k_mask[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        # no `other` for fp8 loads (the interpreter cannot cast it): masked lanes are zeroed below
        x = tl.load(x_rows + ks[None, :], mask=x_mask)   # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + ks[None, :], mask=w_mask)   # [BLOCK_N, BLOCK_K]
        if DOT_IN_FP32:
            x = tl.where(x_mask, x.to(tl.float32), 0.0)
            w = tl.where(w_mask, w.to(tl.float32), 0.0)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        elif FP8_ACT:
            x = tl.where(x_mask, x, tl.zeros_like(x))
            w = tl.where(w_mask, w, tl.zeros_like(w))
            acc += tl.dot(x, tl.trans(w))                       # e4m3 x e4m3 -> fp32
        else:
            x = tl.where(x_mask, x, tl.zeros_like(x))
            w = w.to(x.dtype)
            w = tl.where(w_mask, w, tl.zeros_like(w))
            acc += tl.dot(x, tl.trans(w))                       # int8 / e4m3 are exact in bf16 and fp16
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0).to(tl.float32)   # [BLOCK_N]
    acc = acc * scale[None, :]
    if FP8_ACT:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0)          # [BLOCK_M] fp32
        acc = acc * x_scale[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
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
@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_SM_COUNT


def gemv_blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the GEMV kernels for m rows (1 <= m <= GEMV_MAX_M)."""
    block_m = triton.next_power_of_2(m)
    return (block_m, *GEMV_BLOCKS[block_m])


def choose_split_k(n: int, k: int, block_n: int, block_k: int, sm_count: int) -> tuple[int, int]:
    """(split_k, k_per_split): cut K into slices (whole BLOCK_K steps) until the GEMV grid holds
    about PROGRAMS_PER_SM programs per SM (never more slices than steps)."""
    n_tiles = triton.cdiv(n, block_n)
    k_steps = max(1, triton.cdiv(k, block_k))
    split = max(1, min(k_steps, triton.cdiv(PROGRAMS_PER_SM * sm_count, n_tiles)))
    steps_per_split = triton.cdiv(k_steps, split)
    return triton.cdiv(k_steps, steps_per_split), steps_per_split * block_k


def _check_x(x: torch.Tensor, k: int, who: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{who}: x must be [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"{who}: x dtype {x.dtype} is not one of fp32 / bf16 / fp16")
    if x.shape[1] != k:
        raise ValueError(f"{who}: x has K={x.shape[1]} columns but the weight expects K={k}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"{who}: x needs unit stride along K (call .contiguous()); strides {x.stride()}")


def _check_scale(scale: torch.Tensor, shape: tuple, who: str, name: str = "scale") -> None:
    if tuple(scale.shape) != shape:
        raise ValueError(f"{who}: {name} must have shape {shape}, got {tuple(scale.shape)}")
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{who}: {name} dtype {scale.dtype} is not one of fp32 / bf16 / fp16")
    if scale.stride(-1) != 1 and scale.shape[-1] > 1:
        raise ValueError(f"{who}: {name} needs unit stride along its last axis; strides {scale.stride()}")


def _check_split(split_k: int | None) -> None:
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k={split_k!r} must be an integer >= 1 (or None to choose)")


REDUCE_BLOCK = 1024
REDUCE_NUM_WARPS = 4


def _check_out(out: torch.Tensor | None, x: torch.Tensor, n: int, who: str) -> torch.Tensor:
    """`out` checked, or a new [M, N] tensor in x's dtype."""
    m = x.shape[0]
    if out is None:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or (out.stride(1) != 1 and n > 1):
        raise ValueError(f"{who}: out must be [{m}, {n}] {x.dtype} with unit column stride; "
                         f"got {tuple(out.shape)} {out.dtype}")
    return out


def _gemv_target(out: torch.Tensor, split: int) -> tuple[torch.Tensor, int, int]:
    """(tensor the GEMV writes, its split stride, its row stride): `out` itself for one slice,
    else fresh fp32 partial sums [split, M, N]."""
    if split == 1:
        return out, 0, out.stride(0)
    m, n = out.shape
    partial = torch.empty(split, m, n, dtype=torch.float32, device=out.device)
    return partial, partial.stride(0), partial.stride(1)


def _reduce(target: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if target is not out:  # [split, M, N] fp32 -> out
        m, n = out.shape
        split_k_reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](
            target, out, m, n, target.shape[0], out.stride(0), BLOCK=REDUCE_BLOCK, num_warps=REDUCE_NUM_WARPS)
    return out


def _channel_check(x, q, scale, kind: str, who: str) -> None:
    want = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    if q.dim() != 2 or q.dtype != want:
        raise ValueError(f"{who}: q must be [N, K] {want}, got {tuple(q.shape)} {q.dtype}")
    if q.stride(1) != 1 and q.shape[1] > 1:
        raise ValueError(f"{who}: q needs unit stride along K (row-major); strides {q.stride()}")
    _check_x(x, q.shape[1], who)
    _check_scale(scale, (q.shape[0],), who)


def channel_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, split_k: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMV for int8 / fp8 weights: x [M <= 16, K] -> x @ (q * scale[:, None])^T [M, N] in x's dtype.
    split_k: K slices (None: enough for ~PROGRAMS_PER_SM programs per SM)."""
    kind = "fp8" if q.dtype == torch.float8_e4m3fn else "int8"
    _channel_check(x, q, scale, kind, "channel_gemv")
    _check_split(split_k)
    m, k = x.shape
    n = q.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"channel_gemv: x has M={m} rows; the GEMV takes 1..{GEMV_MAX_M} (use the GEMM)")
    block_m, block_n, block_k = gemv_blocks(m)
    if split_k is None:
        split, per = choose_split_k(n, k, block_n, block_k, _sm_count(x.device))
    else:
        steps = max(1, triton.cdiv(k, block_k))
        per = triton.cdiv(steps, min(split_k, steps)) * block_k
        split = triton.cdiv(max(k, 1), per)
    out = _check_out(out, x, n, "channel_gemv")
    target, stride_os, stride_om = _gemv_target(out, split)
    channel_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, q, scale, target, m, n, k, x.stride(0), q.stride(0), stride_os, stride_om, per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=GEMV_NUM_WARPS)
    return _reduce(target, out)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M]): per-row (per-token) absmax scaling to 448; an
    all-zero row gets scale 1."""
    xf = x.float()
    scale = xf.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (xf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def channel_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fp8_activations: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM for int8 / fp8 weights: x [M, K] -> x @ (q * scale[:, None])^T [M, N] in x's dtype.
    fp8_activations (fp8 weights only): quantize x per row to e4m3 and multiply fp8 x fp8."""
    kind = "fp8" if q.dtype == torch.float8_e4m3fn else "int8"
    _channel_check(x, q, scale, kind, "channel_gemm")
    if fp8_activations and kind != "fp8":
        raise ValueError("channel_gemm: fp8_activations=True needs float8_e4m3fn weights, got int8")
    m, k = x.shape
    n = q.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or (out.stride(1) != 1 and n > 1):
        raise ValueError(f"channel_gemm: out must be [{m}, {n}] {x.dtype} with unit column stride; "
                         f"got {tuple(out.shape)} {out.dtype}")
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = GEMM_LAUNCH[x.dtype]
    x_in, x_scale = x, scale  # x_scale is a placeholder pointer unless FP8_ACT
    if fp8_activations:
        x_in, x_scale = quantize_fp8_rows(x)
        block_k = max(block_k, 64)  # fp8 dots step K by 32
    channel_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x_in, x_scale, q, scale, out, m, n, k, x_in.stride(0), q.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_IN_FP32=dot_in_fp32(x.dtype) or (fp8_activations and _interpreted()), FP8_ACT=fp8_activations,
        num_warps=num_warps, num_stages=num_stages)
    return out


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    _check_x(x, x.shape[1], who)
    _check_scale(scale, (n, kp // group_size), who, "scale")
    _check_scale(zero, (n, kp // group_size), who, "zero")
    if zero.stride() != scale.stride():
        raise ValueError(f"{who}: scale and zero need the same strides; got {scale.stride()} and {zero.stride()}")
    return kp


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              split_k: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMV for int4 group-wise weights: x [M <= 16, K] -> x @ W^T [M, N] in x's dtype,
    W = dequantize_int4(unpack_int4(packed), scale, zero)[:, :K]."""
    kp = _int4_check(x, packed, scale, zero, group_size, "int4_gemv")
    _check_split(split_k)
    m, k = x.shape
    n = packed.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"int4_gemv: x has M={m} rows; the GEMV takes 1..{GEMV_MAX_M} (use the GEMM)")
    block_m, block_n, block_k = gemv_blocks(m)
    if split_k is None:
        split, per = choose_split_k(n, kp, block_n, block_k, _sm_count(x.device))
    else:
        steps = triton.cdiv(kp, block_k)
        per = triton.cdiv(steps, min(split_k, steps)) * block_k
        split = triton.cdiv(kp, per)
    out = _check_out(out, x, n, "int4_gemv")
    target, stride_os, stride_om = _gemv_target(out, split)
    int4_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, packed, scale, zero, target, m, n, k, kp, group_size, x.stride(0), packed.stride(0), scale.stride(0),
        stride_os, stride_om, per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=GEMV_NUM_WARPS)
    return _reduce(target, out)


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


# ------------------------------------------------------------------ the entry points (choose by M)
def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16) @ (q int8 [N, K] * scale [N, None])^T -> [M, N] in x's dtype:
    the GEMV for M <= GEMV_MAX_M (decode), the tl.dot GEMM above."""
    _channel_check(x, q, scale, "int8", "int8_matmul")
    if x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_M:
        return channel_gemv(x, q, scale, out=out)
    return channel_gemm(x, q, scale, out=out)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W the plain int4 layout (packed uint8 [N, Kp / 2],
    scale / zero [N, Kp / group_size]): GEMV for M <= GEMV_MAX_M, GEMM above."""
    if x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_M:
        return int4_gemv(x, packed, scale, zero, group_size, out=out)
    return int4_gemm(x, packed, scale, zero, group_size, out=out)


def fp8_supported(device: torch.device | str) -> bool:
    """Whether fp8_matmul runs the Triton kernels on `device`. A CUDA device: whether its card has
    hardware.GPU_FEATURES["fp8_matmul"] (sm_90+; MINILLM_FAKE_CAPABILITY stands in for the card).
    Any other device: whether the Triton interpreter runs the kernels (TRITON_INTERPRET=1, tests).
    Where it is False, fp8_matmul computes fp8_matmul_reference and Fp8Linear keeps its "dequant" path."""
    device = torch.device(device)
    if device.type != "cuda":
        return _interpreted()
    return missing_gpu_feature(gpu_capability(device), "fp8_matmul") is None


def fp8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fp8_activations: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (q float8_e4m3fn [N, K] * scale [N, None])^T -> [M, N] in x's dtype.

    Where fp8_supported (sm_90+ GPUs): the GEMV for M <= GEMV_MAX_M, the
    tl.dot GEMM above (fp8_activations=True: fp8 x fp8 dots, x quantized per row). Elsewhere
    the fallback: dequantize to x's dtype, then torch's matmul."""
    _channel_check(x, q, scale, "fp8", "fp8_matmul")
    if not fp8_supported(x.device):
        y = fp8_matmul_reference(x, q, scale, fp8_activations)
        return y if out is None else out.copy_(y)
    if not fp8_activations and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_M:
        return channel_gemv(x, q, scale, out=out)
    return channel_gemm(x, q, scale, fp8_activations=fp8_activations, out=out)


# ============================================================== torch references
def int8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale[:, None])^T in fp32, rounded once to x's dtype."""
    return (x.float() @ (q.float() * scale.float()[:, None]).t()).to(x.dtype)


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


def fp8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                         fp8_activations: bool = False) -> torch.Tensor:
    """x @ (float(q) * scale[:, None])^T in fp32, rounded once to x's dtype; fp8_activations:
    x replaced by its per-row e4m3 quantization (quantize_fp8_rows) first."""
    xf = x.float()
    if fp8_activations:
        xq, xs = quantize_fp8_rows(x)
        xf = xq.float() * xs[:, None]
    return (xf @ (q.float() * scale.float()[:, None]).t()).to(x.dtype)
