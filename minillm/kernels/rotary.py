"""Rotary position embedding (RoPE) on q and k, half-split ("neox") style: kernel, launcher, reference.

For a head vector x of head_dim D with halves x1 = x[:D/2], x2 = x[D/2:], and the model's
precomputed tables cos, sin [max_positions, D] (layers/rotary.py) at the token's position:

    out = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x2, x1)
    i.e. out1 = x1 * cos1 - x2 * sin1,  out2 = x2 * cos2 + x1 * sin2

computed in fp32 and rounded once. One program per token rotates all its query heads, then
all its key heads, BLOCK_H heads at a time, so it reads its position's cos/sin row once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROTARY_TILE = 1024   # about this many elements (heads x head_dim) per step of a program
ROTARY_NUM_WARPS = 4


@triton.jit
def _rotate_heads(
    x_ptr,          # [num_heads, head_dim] this token's heads (head stride stride_x_head), unit stride along head_dim
    out_ptr,        # [num_heads, head_dim] where the rotated heads go (head stride stride_o_head); may be x_ptr
    stride_x_head, stride_o_head,
    num_heads, half,
    cos1, sin1, cos2, sin2,  # [BLOCK_HALF] fp32 table halves at this token's position (0 past `half`)
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & dim_mask[None, :]
        src = x_ptr + heads[:, None] * stride_x_head + dims[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)          # [BLOCK_H, BLOCK_HALF]
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
        out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
        dst = out_ptr + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(dst, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr,          # [num_tokens, num_q_heads, head_dim] (strides stride_q_token, stride_q_head)
    k_ptr,          # [num_tokens, num_kv_heads, head_dim] (strides stride_k_token, stride_k_head)
    q_out_ptr,      # [num_tokens, num_q_heads, head_dim] rotated q (strides stride_qo_token, stride_qo_head); may be q_ptr
    k_out_ptr,      # [num_tokens, num_kv_heads, head_dim] rotated k (strides stride_ko_token, stride_ko_head); may be k_ptr
    cos_ptr,        # [max_positions, head_dim] (row stride stride_table; sin has the same strides)
    sin_ptr,        # [max_positions, head_dim]
    positions_ptr,  # [num_tokens] int64 (or int32), position of each token (< max_positions, not checked)
    stride_q_token, stride_q_head,
    stride_k_token, stride_k_head,
    stride_qo_token, stride_qo_head,
    stride_ko_token, stride_ko_head,
    stride_table,
    num_q_heads, num_kv_heads, half,  # half = head_dim // 2
    BLOCK_H: tl.constexpr,     # heads per step (a power of 2)
    BLOCK_HALF: tl.constexpr,  # half rounded up to a power of 2 (head_dim 80: 40 -> 64, masked)
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half
    row = position * stride_table + dims
    cos1 = tl.load(cos_ptr + row, mask=dim_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + row, mask=dim_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + half, mask=dim_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + half, mask=dim_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_q_token, q_out_ptr + token * stride_qo_token, stride_q_head, stride_qo_head,
                  num_q_heads, half, cos1, sin1, cos2, sin2, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_k_token, k_out_ptr + token * stride_ko_token, stride_k_head, stride_ko_head,
                  num_kv_heads, half, cos1, sin1, cos2, sin2, BLOCK_H, BLOCK_HALF)


def rotary_blocks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_HALF) for a head_dim: the launch's only compile-time constants."""
    block_half = triton.next_power_of_2(head_dim // 2)
    return max(1, ROTARY_TILE // (2 * block_half)), block_half


def _check_heads(name: str, x: torch.Tensor, num_tokens: int, head_dim: int, dtype: torch.dtype) -> None:
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[2] != head_dim or x.dtype != dtype or x.stride(2) != 1:
        raise ValueError(f"rotary_embedding wants {name} [{num_tokens}, heads, {head_dim}] {dtype} with unit stride "
                         f"along head_dim; got {tuple(x.shape)} {x.dtype} strides {x.stride()}")


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, q_out: torch.Tensor | None = None,
                     k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]; cos, sin: [max_positions, D] -> rotated (q, k).

    In place by default (q and k may be strided views, e.g. of a fused qkv projection);
    pass q_out / k_out (same shapes) to write elsewhere. Positions are not range-checked
    (that would sync with the GPU).
    """
    if q.dim() != 3 or q.shape[2] % 2:
        raise ValueError(f"rotary_embedding wants q [num_tokens, num_heads, head_dim] with an even head_dim; "
                         f"got {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"rotary_embedding wants fp32/bf16/fp16 q; got {q.dtype}")
    _check_heads("k", k, num_tokens, head_dim, q.dtype)
    q_out = q if q_out is None else q_out
    k_out = k if k_out is None else k_out
    _check_heads("q", q, num_tokens, head_dim, q.dtype)
    _check_heads("q_out", q_out, num_tokens, head_dim, q.dtype)
    _check_heads("k_out", k_out, num_tokens, head_dim, q.dtype)
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError(f"q_out / k_out must be shaped like q {tuple(q.shape)} / k {tuple(k.shape)}; "
                         f"got {tuple(q_out.shape)} / {tuple(k_out.shape)}")
    if cos.dim() != 2 or cos.shape[1] != head_dim or sin.shape != cos.shape or cos.stride() != sin.stride() \
            or cos.stride(1) != 1:
        raise ValueError(f"rotary_embedding wants cos, sin [max_positions, {head_dim}] with identical strides and "
                         f"unit stride along head_dim; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rotary_embedding wants positions [{num_tokens}] int64; "
                         f"got {tuple(positions.shape)} {positions.dtype}")
    if num_tokens == 0:
        return q_out, k_out
    block_h, block_half = rotary_blocks(head_dim)
    rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        num_q_heads, k.shape[1], head_dim // 2,
        BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=ROTARY_NUM_WARPS,
    )
    return q_out, k_out


def rotary_embedding_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, in fp32, rounded once to q's dtype."""
    cos_t = cos[positions.long()].float().unsqueeze(1)  # [T, 1, D]
    sin_t = sin[positions.long()].float().unsqueeze(1)

    def rotate(x):
        x32 = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
        return (x32 * cos_t + rotated * sin_t).to(x.dtype)

    return rotate(q), rotate(k)
