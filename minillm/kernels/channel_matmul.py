"""Per-output-channel int8 / fp8 weight matmuls y = x (q * scale[:, None])^T: kernels, launchers, references.

The weights stay in their stored format in memory (what makes decode faster: it reads fewer
bytes); each program converts the tile it loaded to floating point and multiplies there, with
fp32 sums. Two formats share these kernels (minillm/quant):

- int8, per output channel:     W = q * scale[:, None]          q int8 [N, K], scale [N]
- fp8 e4m3, per output channel: W = float(q) * scale[:, None]   q float8_e4m3fn [N, K], scale [N]

`channel_gemv_kernel` runs decode batches (M <= GEMV_MAX_M, split-K: quant_launch.py,
split_k_reduce.py); `channel_gemm_kernel` runs prefill through `tl.dot`, the weight tile converted
in registers to x's dtype (int8 and e4m3 are exact in bf16 / fp16) and multiplied on the tensor
cores; fp32 activations use exact fp32 dots. The scale is applied once per output channel, after
the sum. `int8_matmul` / `fp8_matmul` choose between them by M.

fp8 has a second GEMM mode, `fp8_matmul(..., fp8_activations=True)`: x is quantized per row
(token) to e4m3 with scale max|x[m]| / 448, and `tl.dot` takes both operands in fp8 (Hopper's
fp8 tensor cores; AOT compiles it for sm_90). It is W8A8, not weight-only: the
activations lose precision too, which is why QuantizedLinear does not use it by default.
fp8 kernels run on sm_90 (Hopper: fp8 conversions and tensor cores; Triton refuses e4m3 on
sm_80), the only fp8 target compiled ahead of time; QuantizedLinear keeps its dequantize
path elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..hardware import gpu_capability, missing_gpu_feature
from .paged_decode import dot_in_fp32
from .quant_launch import (GEMM_LAUNCH, GEMV_MAX_M, GEMV_NUM_WARPS, check_out, check_scale, check_split, check_x,
                           choose_split_k, gemv_blocks, interpreted, sm_count)
from .split_k_reduce import split_k_reduce, split_k_target

FP8_MAX = 448.0           # largest finite e4m3 value


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


# ============================================================== launchers
def _channel_check(x, q, scale, kind: str, who: str) -> None:
    want = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    if q.dim() != 2 or q.dtype != want:
        raise ValueError(f"{who}: q must be [N, K] {want}, got {tuple(q.shape)} {q.dtype}")
    if q.stride(1) != 1 and q.shape[1] > 1:
        raise ValueError(f"{who}: q needs unit stride along K (row-major); strides {q.stride()}")
    check_x(x, q.shape[1], who)
    check_scale(scale, (q.shape[0],), who)


def channel_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, split_k: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMV for int8 / fp8 weights: x [M <= 16, K] -> x @ (q * scale[:, None])^T [M, N] in x's dtype.
    split_k: K slices (None: enough for ~PROGRAMS_PER_SM programs per SM)."""
    kind = "fp8" if q.dtype == torch.float8_e4m3fn else "int8"
    _channel_check(x, q, scale, kind, "channel_gemv")
    check_split(split_k)
    m, k = x.shape
    n = q.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"channel_gemv: x has M={m} rows; the GEMV takes 1..{GEMV_MAX_M} (use the GEMM)")
    block_m, block_n, block_k = gemv_blocks(m)
    if split_k is None:
        split, per = choose_split_k(n, k, block_n, block_k, sm_count(x.device))
    else:
        steps = max(1, triton.cdiv(k, block_k))
        per = triton.cdiv(steps, min(split_k, steps)) * block_k
        split = triton.cdiv(max(k, 1), per)
    out = check_out(out, x, n, "channel_gemv")
    target, stride_os, stride_om = split_k_target(out, split)
    channel_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, q, scale, target, m, n, k, x.stride(0), q.stride(0), stride_os, stride_om, per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=GEMV_NUM_WARPS)
    return split_k_reduce(target, out)


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
        DOT_IN_FP32=dot_in_fp32(x.dtype) or (fp8_activations and interpreted()), FP8_ACT=fp8_activations,
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


def fp8_supported(device: torch.device | str) -> bool:
    """Whether fp8_matmul runs the Triton kernels on `device`. A CUDA device: whether its card has
    hardware.GPU_FEATURES["fp8_matmul"] (sm_90+; MINILLM_FAKE_CAPABILITY stands in for the card).
    Any other device: whether the Triton interpreter runs the kernels (TRITON_INTERPRET=1, tests).
    Where it is False, fp8_matmul computes fp8_matmul_reference and Fp8Linear keeps its "dequant" path."""
    device = torch.device(device)
    if device.type != "cuda":
        return interpreted()
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


def fp8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                         fp8_activations: bool = False) -> torch.Tensor:
    """x @ (float(q) * scale[:, None])^T in fp32, rounded once to x's dtype; fp8_activations:
    x replaced by its per-row e4m3 quantization (quantize_fp8_rows) first."""
    xf = x.float()
    if fp8_activations:
        xq, xs = quantize_fp8_rows(x)
        xf = xq.float() * xs[:, None]
    return (xf @ (q.float() * scale.float()[:, None]).t()).to(x.dtype)
