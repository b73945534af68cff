"""Batched multi-LoRA: SGMV shrink and expand kernels (Punica's, as vLLM's sgmv_shrink / sgmv_expand), launchers,
and the torch reference.

Every token of a batch may use its own adapter. The delta of one linear layer is

    y[t] += (x[t] @ A[s]^T) @ B[s]^T        s = the slot of token t's adapter (0: none, no delta)

with the adapters stacked per layer: A [num_slots, rank, in_features], B [num_slots, out_features, rank] (the
scaling lora_alpha / r already folded into B; ranks below the slot's are zero-padded). Tokens are grouped into
segments, runs of consecutive tokens on one adapter (a prefill is one long segment, a decode step one token per
sequence). `shrink` computes x A^T -> [tokens, rank] in fp32, `expand` adds (.) B^T into a column slice of y.
One program owns a tile of BLOCK_M tokens of one segment (and, in expand, BLOCK_N output columns); slot-0
segments, and tiles past a segment's end, return at once.

A fused layer (q|k|v, gate|up) shrinks once with its slices' A concatenated along the rank ([S, 3 r, in]) and
expands each slice into its columns of the fused output (`inp` and `y` are column views; strides do the rest).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_decode import dot_in_fp32   # fp32 inputs; bf16 too in the interpreter (its bf16 tl.dot is wrong)

LORA_BLOCK_M = 16     # tokens per program (tl.dot needs >= 16)
SHRINK_BLOCK_K = 64   # input features per loop step
EXPAND_BLOCK_N = 64   # output features per program
LORA_NUM_WARPS = 4


def rank_block(rank: int) -> int:
    """BLOCK_R for a rank: a power of 2, at least 16 (tl.dot's smallest dimension); the tail is masked."""
    return max(16, triton.next_power_of_2(rank))


@triton.jit
def sgmv_shrink_kernel(
    x_ptr,          # [num_tokens, in_features] (row stride stride_xt), unit column stride
    a_ptr,          # [num_slots, rank, in_features] (strides stride_as, stride_ar, 1): the adapters' A
    out_ptr,        # [num_tokens, rank] fp32 (row stride stride_ot), unit column stride
    seg_start_ptr,  # [num_segments] int32: first token of each segment
    seg_len_ptr,    # [num_segments] int32: its token count
    seg_slot_ptr,   # [num_segments] int32: its adapter's slot (0: no adapter, skipped)
    stride_xt, stride_as, stride_ar, stride_ot,
    in_features, rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # exact (ieee) fp32 dots: fp32 inputs (not tf32), and bf16 in the interpreter
):
    seg = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    slot = tl.load(seg_slot_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    if slot == 0 or m_start >= length:   # no adapter, or past this segment's end (the grid fits the longest)
        return
    start = tl.load(seg_start_ptr + seg)
    rows = m_start + tl.arange(0, BLOCK_M)
    row_mask = rows < length
    tokens = (start + rows).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        cols = k_start + tl.arange(0, BLOCK_K)
        col_mask = cols < in_features
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)              # [BLOCK_M, BLOCK_K]
        a = tl.load(a_base + ranks[:, None] * stride_ar + cols[None, :],
                    mask=rank_mask[:, None] & col_mask[None, :], other=0.0)             # [BLOCK_R, BLOCK_K]
        if DOT_IN_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a.to(x.dtype)))
    tl.store(out_ptr + tokens[:, None] * stride_ot + ranks[None, :], acc,
             mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def sgmv_expand_kernel(
    inp_ptr,        # [num_tokens, rank] fp32 (row stride stride_it), unit column stride: shrink's output
    b_ptr,          # [num_slots, out_features, rank] (strides stride_bs, stride_bn, 1): the adapters' B, scaled
    y_ptr,          # [num_tokens, out_features] (row stride stride_yt), unit column stride: y += inp B^T
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,    # [num_segments] int32
    seg_slot_ptr,   # [num_segments] int32 (0: skipped)
    stride_it, stride_bs, stride_bn, stride_yt,
    out_features, rank,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    seg = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    slot = tl.load(seg_slot_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    if slot == 0 or m_start >= length:
        return
    start = tl.load(seg_start_ptr + seg)
    rows = m_start + tl.arange(0, BLOCK_M)
    row_mask = rows < length
    tokens = (start + rows).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    inp = tl.load(inp_ptr + tokens[:, None] * stride_it + ranks[None, :],
                  mask=row_mask[:, None] & rank_mask[None, :], other=0.0)               # [BLOCK_M, BLOCK_R] fp32
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bn + ranks[None, :],
                mask=col_mask[:, None] & rank_mask[None, :], other=0.0)                 # [BLOCK_N, BLOCK_R]
    if DOT_IN_FP32:
        delta = tl.dot(inp, tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        delta = tl.dot(inp.to(b.dtype), tl.trans(b))                                     # [BLOCK_M, BLOCK_N] fp32
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _check_segments(seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor, device) -> None:
    for name, t in (("seg_starts", seg_starts), ("seg_lens", seg_lens), ("seg_slots", seg_slots)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.device != device:
            raise ValueError(f"{name} must be a 1-D int32 tensor on {device}; got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
    if not seg_starts.shape == seg_lens.shape == seg_slots.shape:
        raise ValueError(f"seg_starts, seg_lens, seg_slots must have one entry per segment; got "
                         f"{seg_starts.shape[0]}, {seg_lens.shape[0]}, {seg_slots.shape[0]}")


def sgmv_shrink(x: torch.Tensor, a_stacked: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                seg_slots: torch.Tensor, max_seg_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ A[slot]^T per segment -> out [T, rank] fp32 (rows of slot-0 segments are left as they were).

    a_stacked: [num_slots, rank, in] contiguous, x's dtype. max_seg_len: the longest segment (sizes the grid)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"sgmv_shrink wants x [num_tokens, in_features] with unit column stride; got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if a_stacked.dim() != 3 or a_stacked.shape[2] != x.shape[1] or not a_stacked.is_contiguous() \
            or a_stacked.dtype != x.dtype:
        raise ValueError(f"sgmv_shrink wants A [num_slots, rank, {x.shape[1]}] contiguous {x.dtype}; got "
                         f"{tuple(a_stacked.shape)} {a_stacked.dtype}")
    _check_segments(seg_starts, seg_lens, seg_slots, x.device)
    rank = a_stacked.shape[1]
    if out is None:
        out = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    elif out.shape != (x.shape[0], rank) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be [{x.shape[0]}, {rank}] fp32 with unit column stride; got {tuple(out.shape)} "
                         f"{out.dtype}")
    if seg_slots.numel() == 0 or max_seg_len == 0:
        return out
    grid = (seg_slots.shape[0], triton.cdiv(max_seg_len, LORA_BLOCK_M))
    sgmv_shrink_kernel[grid](
        x, a_stacked, out, seg_starts, seg_lens, seg_slots,
        x.stride(0), a_stacked.stride(0), a_stacked.stride(1), out.stride(0), x.shape[1], rank,
        BLOCK_M=LORA_BLOCK_M, BLOCK_R=rank_block(rank), BLOCK_K=SHRINK_BLOCK_K, DOT_IN_FP32=dot_in_fp32(x.dtype),
        num_warps=LORA_NUM_WARPS,
    )
    return out


def sgmv_expand(inp: torch.Tensor, b_stacked: torch.Tensor, y: torch.Tensor, seg_starts: torch.Tensor,
                seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int) -> torch.Tensor:
    """y [T, out] += inp [T, rank] (fp32) @ B[slot]^T per segment, in place; y may be a column slice of a fused
    output. b_stacked: [num_slots, out, rank] contiguous, y's dtype. Returns y."""
    if inp.dim() != 2 or inp.stride(1) != 1 or inp.dtype != torch.float32:
        raise ValueError(f"sgmv_expand wants inp [num_tokens, rank] fp32 with unit column stride; got "
                         f"{tuple(inp.shape)} {inp.dtype} strides {inp.stride()}")
    if y.dim() != 2 or y.stride(1) != 1 or y.shape[0] != inp.shape[0]:
        raise ValueError(f"sgmv_expand wants y [{inp.shape[0]}, out_features] with unit column stride; got "
                         f"{tuple(y.shape)} strides {y.stride()}")
    if b_stacked.dim() != 3 or b_stacked.shape[1:] != (y.shape[1], inp.shape[1]) or not b_stacked.is_contiguous() \
            or b_stacked.dtype != y.dtype:
        raise ValueError(f"sgmv_expand wants B [num_slots, {y.shape[1]}, {inp.shape[1]}] contiguous {y.dtype}; got "
                         f"{tuple(b_stacked.shape)} {b_stacked.dtype}")
    _check_segments(seg_starts, seg_lens, seg_slots, y.device)
    if seg_slots.numel() == 0 or max_seg_len == 0:
        return y
    rank, out_features = inp.shape[1], y.shape[1]
    grid = (seg_slots.shape[0], triton.cdiv(max_seg_len, LORA_BLOCK_M), triton.cdiv(out_features, EXPAND_BLOCK_N))
    sgmv_expand_kernel[grid](
        inp, b_stacked, y, seg_starts, seg_lens, seg_slots,
        inp.stride(0), b_stacked.stride(0), b_stacked.stride(1), y.stride(0), out_features, rank,
        BLOCK_M=LORA_BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=rank_block(rank), DOT_IN_FP32=dot_in_fp32(y.dtype),
        num_warps=LORA_NUM_WARPS,
    )
    return y


# ----------------------------------------------------------------------------- torch reference
def token_slots_from_segments(num_tokens: int, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                              seg_slots: torch.Tensor) -> torch.Tensor:
    """[num_tokens] int64 slot of each token (0 outside every segment)."""
    slots = torch.zeros(num_tokens, dtype=torch.long, device=seg_slots.device)
    for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        slots[start:start + length] = slot
    return slots


def lora_shrink_reference(x: torch.Tensor, a_stacked: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[T, in] -> [T, rank] fp32: each token times its own adapter's A (gathered by slot, one bmm)."""
    a = a_stacked.float()[token_slots]                                   # [T, rank, in]
    return torch.bmm(a, x.float().unsqueeze(2)).squeeze(2)


def lora_expand_reference(inp: torch.Tensor, b_stacked: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[T, rank] fp32 -> the delta [T, out] fp32: each token times its own adapter's B."""
    b = b_stacked.float()[token_slots]                                   # [T, out, rank]
    return torch.bmm(b, inp.float().unsqueeze(2)).squeeze(2)


def lora_delta_reference(x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor,
                         token_slots: torch.Tensor) -> torch.Tensor:
    """The whole delta (x A^T) B^T per token, fp32 [T, out]; slot 0 holds zeros, so its tokens get 0."""
    return lora_expand_reference(lora_shrink_reference(x, a_stacked, token_slots), b_stacked, token_slots)
