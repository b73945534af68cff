"""Launch helpers shared by the low-bit matmul kernels: tile and split-K choice, shape and dtype checks.

The kernels (channel_matmul.py for int8 / fp8 weights, int4_matmul.py for int4) come in two shapes,
chosen by the number of rows M of x:

1. GEMV (decode, M <= GEMV_MAX_M = 16): grid (cdiv(N, BLOCK_N), split_k). A program takes
   BLOCK_N output channels and one slice of K, all M rows at once: x [BLOCK_M, BLOCK_K] times
   W [BLOCK_N, BLOCK_K] as a broadcast product summed along K on the CUDA cores (no tl.dot: it
   would pad M to 16 rows). BLOCK_M = M rounded up to a power of 2, and BLOCK_N x BLOCK_K
   shrink as BLOCK_M grows so the product tile stays ~8K fp32 values (64 registers a thread at
   4 warps). Split-K: with a few rows, N / BLOCK_N programs would leave most SMs idle, so K is
   cut into slices (about PROGRAMS_PER_SM programs per SM in all; split_k_reduce.py adds them up).
2. GEMM (prefill, M > 16): grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)), tiles through `tl.dot`
   (BLOCK_M >= 16), launched with GEMM_LAUNCH's tiles for the activation dtype.

Every launcher checks shapes and dtypes and raises ValueError naming the value and what is
allowed. Kernels take element strides for rows; the K axis must be unit-stride.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

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
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------ tiles and split-K
@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's SM count (DEFAULT_SM_COUNT off a GPU: the interpreter, AOT)."""
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


def interpreted() -> bool:
    """Whether the kernels run under the Triton interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------ checks
def check_x(x: torch.Tensor, k: int, who: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{who}: x must be [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"{who}: x dtype {x.dtype} is not one of fp32 / bf16 / fp16")
    if x.shape[1] != k:
        raise ValueError(f"{who}: x has K={x.shape[1]} columns but the weight expects K={k}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"{who}: x needs unit stride along K (call .contiguous()); strides {x.stride()}")


def check_scale(scale: torch.Tensor, shape: tuple, who: str, name: str = "scale") -> None:
    if tuple(scale.shape) != shape:
        raise ValueError(f"{who}: {name} must have shape {shape}, got {tuple(scale.shape)}")
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"{who}: {name} dtype {scale.dtype} is not one of fp32 / bf16 / fp16")
    if scale.stride(-1) != 1 and scale.shape[-1] > 1:
        raise ValueError(f"{who}: {name} needs unit stride along its last axis; strides {scale.stride()}")


def check_split(split_k: int | None) -> None:
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k={split_k!r} must be an integer >= 1 (or None to choose)")


def check_out(out: torch.Tensor | None, x: torch.Tensor, n: int, who: str) -> torch.Tensor:
    """`out` checked, or a new [M, N] tensor in x's dtype."""
    m = x.shape[0]
    if out is None:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or (out.stride(1) != 1 and n > 1):
        raise ValueError(f"{who}: out must be [{m}, {n}] {x.dtype} with unit column stride; "
                         f"got {tuple(out.shape)} {out.dtype}")
    return out
