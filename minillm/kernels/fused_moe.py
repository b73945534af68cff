"""Fused mixture-of-experts MLP (vLLM's fused_moe design): alignment, grouped-matmul kernel, launcher, reference.

Each token picked top_k experts, so the step has num_pairs = num_tokens * top_k (token, expert) pairs;
pair p is token p // top_k's choice p % top_k. `moe_align` sorts the pairs by expert and pads each
expert's run to a multiple of BLOCK_M (padding entries hold num_pairs, an id no pair has), so every
BLOCK_M tile of the sorted list belongs to one expert. One kernel then runs over (tiles, N blocks): a
program loads its tile's expert id, gathers the tile's activation rows and multiplies them by that
expert's weights. Two launches make the MLP:

    1. GATED: rows of the hidden states x [T, H] times the expert's gate and up rows of w13 [E, 2I, H]
       (two accumulators), then silu(gate) * up  -> act [num_pairs, I]   (the SwiGLU fused in)
    2. rows of act times w2 [E, H, I], times the pair's routing weight    -> out [num_pairs, H]

and a sum over each token's top_k rows gives [T, H]. Quantized experts (WEIGHT_FORMAT): int8 with one
fp32 scale per output row (quant/int8.py's format, per expert), applied to the accumulator; int4 packed
two per byte with a scale and a zero per group of input channels (quant/int4.py's format, the input
dimension padded to the group), dequantized tile by tile in registers.

No host sync: the launch covers the most tiles the pairs can fill (num_pairs / BLOCK_M + E) and a
tile past the last expert's run (expert id -1) returns at once, so the launch is graph-capturable.

`experts_reference` is the plain torch loop (one matmul pair per expert hit, index_add into the
output), transformers' MixtralExperts / Qwen2MoeExperts order of operations.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .paged_decode import dot_in_fp32

# (BLOCK_N, BLOCK_K, num_warps, num_stages) per activation dtype; BLOCK_M is 16 for decode-sized
# batches and 64 when the pairs fill bigger tiles (moe_block_m). fp32 tiles take twice the registers.
MOE_LAUNCH = {
    torch.float32: (32, 32, 4, 2),
    torch.bfloat16: (64, 64, 4, 3),
    torch.float16: (64, 64, 4, 3),
}
MOE_BLOCK_MS = (16, 64)
ACT_DTYPES = tuple(MOE_LAUNCH)


@triton.jit
def fused_moe_kernel(
    a_ptr,             # [num_rows, K] activations (row stride stride_am, unit along K); pair p reads row p // A_ROWS_PER
    b_ptr,             # [E, N or 2N, K] float / int8 expert weights, or [E, N or 2N, Kp / 2] uint8 int4 pairs
                       # (low nibble = even column) (strides stride_be, stride_bn; unit along K)
    b_scale_ptr,       # int8: [E, N or 2N] fp32 per-row scales; int4: [E, N or 2N, Kp / group_size] fp32 group
                       # scales (strides stride_se, stride_sn); unused for float weights
    b_zero_ptr,        # int4: group zeros, b_scale's shape and strides; unused otherwise
    c_ptr,             # [num_pairs, N] output, one row per pair (row stride stride_cm)
    topk_weights_ptr,  # [num_pairs] fp32 routing weights (read when MUL_ROUTED_WEIGHT)
    sorted_ids_ptr,    # [max_padded] int32 pair ids grouped by expert, each run padded with num_pairs
    tile_experts_ptr,  # [max_tiles] int32 expert of each BLOCK_M tile of sorted_ids, -1 past the last run
    N, K, Kp, group_size, num_pairs,     # Kp, group_size: int4's padded K and group (else K and 1)
    stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn,
    A_ROWS_PER: tl.constexpr,         # pairs per activation row: top_k for x, 1 for the per-pair act
    GATED: tl.constexpr,              # rows n and N + n of b are gate and up: output silu(gate) * up
    MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
    WEIGHT_FORMAT: tl.constexpr,      # 0: float b; 1: int8 b times b_scale per row; 2: int4 groups
    DOT_IN_FP32: tl.constexpr,        # exact fp32 dots (fp32 activations; bf16 under the interpreter)
    BLOCK_M: tl.constexpr,            # pairs per tile (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_experts_ptr + pid_m)
    if expert < 0:      # past the last expert's run: nothing to do
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + slots)                          # [BLOCK_M]
    row_mask = pairs < num_pairs                                     # padding entries hold num_pairs
    a_rows = a_ptr + (pairs // A_ROWS_PER).to(tl.int64)[:, None] * stride_am   # [BLOCK_M, 1]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b_expert = b_ptr + expert.to(tl.int64) * stride_be
    b_rows = b_expert + cols.to(tl.int64)[:, None] * stride_bn                 # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if WEIGHT_FORMAT == 2:
        s_rows = b_scale_ptr + expert.to(tl.int64) * stride_se + cols.to(tl.int64)[:, None] * stride_sn
        z_rows = b_zero_ptr + expert.to(tl.int64) * stride_se + cols.to(tl.int64)[:, None] * stride_sn
        for k0 in range(0, Kp, BLOCK_K):
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)   # packed (byte) columns
            even = 2 * half
            w_mask = col_mask[:, None] & (even < Kp)[None, :]
            x_even = tl.load(a_rows + even[None, :], mask=row_mask[:, None] & (even < K)[None, :], other=0.0)
            x_odd = tl.load(a_rows + even[None, :] + 1, mask=row_mask[:, None] & (even + 1 < K)[None, :], other=0.0)
            acc = _int4_tile_dot(acc, x_even, x_odd, b_rows, s_rows, z_rows, half, even, w_mask, group_size,
                                 DOT_IN_FP32)
            if GATED:
                acc_up = _int4_tile_dot(acc_up, x_even, x_odd, b_rows + N * stride_bn, s_rows + N * stride_sn,
                                        z_rows + N * stride_sn, half, even, w_mask, group_size, DOT_IN_FP32)
    else:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a_mask = row_mask[:, None] & k_mask[None, :]
            b_mask = col_mask[:, None] & k_mask[None, :]
            a = tl.load(a_rows + ks[None, :], mask=a_mask, other=0.0)    # [BLOCK_M, BLOCK_K]
            b = tl.load(b_rows + ks[None, :], mask=b_mask, other=0)      # [BLOCK_N, BLOCK_K]
            if DOT_IN_FP32:
                acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(b.to(a.dtype)))                # int8 is exact in bf16 / fp16
            if GATED:
                b_up = tl.load(b_rows + N * stride_bn + ks[None, :], mask=b_mask, other=0)
                if DOT_IN_FP32:
                    acc_up += tl.dot(a.to(tl.float32), tl.trans(b_up.to(tl.float32)), input_precision="ieee")
                else:
                    acc_up += tl.dot(a, tl.trans(b_up.to(a.dtype)))
    if WEIGHT_FORMAT == 1:
        scales = b_scale_ptr + expert.to(tl.int64) * stride_se + cols
        acc = acc * tl.load(scales, mask=col_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scales + N, mask=col_mask, other=0.0)[None, :]
    if GATED:
        if not DOT_IN_FP32:   # the model rounds each projection to its dtype before the activation (not in
                              # the interpreter, whose casts to bf16 truncate)
            acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
            acc_up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up                    # silu(gate) * up
    if MUL_ROUTED_WEIGHT:
        if not DOT_IN_FP32:
            acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        weights = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)  # [BLOCK_M] fp32
        acc = acc * weights[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _int4_tile_dot(acc, x_even, x_odd, p_rows, s_rows, z_rows, half, even, w_mask, group_size,
                   DOT_IN_FP32: tl.constexpr):
    """acc + x [BLOCK_M, BLOCK_K] times a [BLOCK_N, BLOCK_K] int4 tile (even and odd columns apart), each
    weight dequantized to q * scale + zero (rounded to x's 16-bit dtype for the dot)."""
    p = tl.load(p_rows + half[None, :], mask=w_mask, other=0)          # [BLOCK_N, BLOCK_K / 2] uint8
    group = (even // group_size)[None, :]
    s = tl.load(s_rows + group, mask=w_mask, other=0.0).to(tl.float32)
    z = tl.load(z_rows + group, mask=w_mask, other=0.0).to(tl.float32)
    w_even = (p & 0xF).to(tl.float32) * s + z
    w_odd = (p >> 4).to(tl.float32) * s + z
    if DOT_IN_FP32:   # fp32, or bf16 in the interpreter (whose casts to bf16 truncate: the weights stay fp32)
        acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even), input_precision="ieee")
        acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), input_precision="ieee")
    else:
        acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
        acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
    return acc


# ============================================================== alignment
def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M for a step: 16 while an expert averages at most 16 pairs (decode), else 64."""
    return MOE_BLOCK_MS[0] if num_pairs <= MOE_BLOCK_MS[0] * num_experts else MOE_BLOCK_MS[1]


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] -> (sorted_ids int32 [max_padded], tile_experts int32 [max_tiles], counts int64 [E]).

    sorted_ids lists the pair ids (t * top_k + j) of expert 0, then expert 1, ..., each expert's run
    padded to a multiple of block_m with num_pairs; tile_experts[i] is the expert of tile i
    (sorted_ids[i * block_m: (i + 1) * block_m]), -1 for tiles past the last run. counts[e]: pairs
    routed to expert e. Sizes depend on T, top_k and E only (no host sync)."""
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    max_tiles = triton.cdiv(num_pairs, block_m) + num_experts
    order = torch.sort(flat, stable=True).indices                   # pair ids grouped by expert
    sorted_experts = flat[order].long()
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_ids = torch.full((max_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(padded_end - padded)[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(max_tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_ids, tile_experts, counts


# ============================================================== launcher
class ExpertWeights(NamedTuple):
    """One stacked expert matrix [E, N, K] as stored: float (scale, zero None), int8 q with scale [E, N], or
    int4 packed uint8 [E, N, Kp / 2] with scale and zero [E, N, Kp / group_size] (quant/int4.py)."""
    w: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    group_size: int | None = None

    @property
    def weight_format(self) -> int:
        return 2 if self.w.dtype == torch.uint8 else 1 if self.w.dtype == torch.int8 else 0

    @property
    def padded_k(self) -> int:
        return self.w.shape[2] * 2 if self.weight_format == 2 else self.w.shape[2]

    def dequantized(self, e: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's [N, k] matrix in dtype (what the kernel multiplies by)."""
        if self.weight_format == 0:
            return self.w[e]
        if self.weight_format == 1:
            return (self.w[e].float() * self.scale[e, :, None].float()).to(dtype)
        low, high = self.w[e] & 0x0F, self.w[e] >> 4
        q = torch.stack([low, high], dim=-1).reshape(self.w.shape[1], -1).float()
        groups = q.shape[1] // self.group_size
        w = q.reshape(q.shape[0], groups, self.group_size) * self.scale[e, :, :, None].float() + self.zero[e, :, :, None].float()
        return w.reshape(q.shape[0], -1)[:, :k].to(dtype)


def _check_weights(name: str, ew: ExpertWeights, x: torch.Tensor, rows: int, k: int, num_experts: int | None) -> None:
    w, fmt = ew.w, ew.weight_format
    if w.dim() != 3 or w.shape[1] != rows or (num_experts is not None and w.shape[0] != num_experts) or w.stride(2) != 1:
        raise ValueError(f"fused_moe: {name} has shape {tuple(w.shape)} (strides {w.stride()}); expected "
                         f"[E, {rows}, {k if fmt != 2 else 'Kp / 2'}] with unit stride along the last dimension")
    if fmt == 0 and (w.dtype != x.dtype or w.shape[2] != k or ew.scale is not None):
        raise ValueError(f"fused_moe: float {name} must be [E, {rows}, {k}] in x's dtype {x.dtype} without scales; "
                         f"got {tuple(w.shape)} {w.dtype}")
    if fmt == 1 and (w.shape[2] != k or ew.scale is None or tuple(ew.scale.shape) != (w.shape[0], rows)):
        raise ValueError(f"fused_moe: int8 {name} [E, {rows}, {k}] needs its scale [E, {rows}]; got "
                         f"{tuple(w.shape)}, scale {None if ew.scale is None else tuple(ew.scale.shape)}")
    if fmt == 2:
        g = ew.group_size
        if not isinstance(g, int) or g < 2 or g % 2 or ew.padded_k % g or not 0 <= ew.padded_k - k < g:
            raise ValueError(f"fused_moe: int4 {name} holds {ew.padded_k} columns for K={k}: K must be padded to a "
                             f"multiple of group_size={g!r} (an even integer)")
        want = (w.shape[0], rows, ew.padded_k // g)
        if ew.scale is None or ew.zero is None or tuple(ew.scale.shape) != want or tuple(ew.zero.shape) != want:
            raise ValueError(f"fused_moe: int4 {name} needs scale and zero of shape {list(want)}")


def _check(x, w13: ExpertWeights, w2: ExpertWeights, topk_weights, topk_ids) -> tuple[int, int]:
    """Returns (num_experts, intermediate)."""
    if x.dim() != 2 or x.dtype not in ACT_DTYPES:
        raise ValueError(f"fused_moe wants x [num_tokens, hidden] in {ACT_DTYPES}; got {tuple(x.shape)} {x.dtype}")
    if w13.w.dim() != 3 or w13.w.shape[1] % 2:
        raise ValueError(f"fused_moe wants w13 [E, 2 * I, hidden]; got {tuple(w13.w.shape)}")
    num_experts, inter, hidden = w13.w.shape[0], w13.w.shape[1] // 2, x.shape[1]
    if w13.weight_format != 2 and w13.w.shape[2] != hidden or w2.w.dim() != 3 or w2.w.shape[1] != hidden:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.w.shape)} and w2 {tuple(w2.w.shape)} do not "
                         "match (x [T, H], w13 [E, 2I, H], w2 [E, H, I])")
    _check_weights("w13", w13, x, 2 * inter, hidden, None)
    _check_weights("w2", w2, x, hidden, inter, num_experts)
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [num_tokens={x.shape[0]}, top_k]")
    return num_experts, inter


def _grouped_matmul(a, ew: ExpertWeights, c, topk_weights, sorted_ids, tile_experts, rows_per, gated, routed, block_m):
    n, k = c.shape[1], a.shape[1]
    block_n, block_k, num_warps, num_stages = MOE_LAUNCH[a.dtype]
    fmt = ew.weight_format
    scale = ew.scale if fmt else topk_weights            # unused pointers get any fp32 tensor
    zero = ew.zero if fmt == 2 else topk_weights
    grid = (tile_experts.numel(), triton.cdiv(n, block_n))
    fused_moe_kernel[grid](
        a, ew.w, scale, zero, c, topk_weights, sorted_ids, tile_experts,
        n, k, ew.padded_k, ew.group_size if fmt == 2 else 1, c.shape[0],
        a.stride(0), ew.w.stride(0), ew.w.stride(1), c.stride(0),
        scale.stride(0) if fmt else 0, scale.stride(1) if fmt == 2 else 0,
        A_ROWS_PER=rows_per, GATED=gated, MUL_ROUTED_WEIGHT=routed, WEIGHT_FORMAT=fmt,
        DOT_IN_FP32=dot_in_fp32(a.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )


def _as_weights(w, scale, zero, group_size) -> ExpertWeights:
    return w if isinstance(w, ExpertWeights) else ExpertWeights(w, scale, zero, group_size)


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              aligned: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights [T, k] (fp32),
    topk_ids [T, k] -> sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t]): [T, H] in x's dtype.

    Float experts: tensors in x's dtype. int8 experts: int8 tensors with w13_scale [E, 2I] / w2_scale [E, H]
    (W = q * scale[..., None]). int4 experts: w13 / w2 as ExpertWeights(packed, scale, zero, group_size).
    aligned: moe_align's (sorted_ids, tile_experts) and its block_m, when the caller has them already."""
    w13, w2 = _as_weights(w13, w13_scale, None, None), _as_weights(w2, w2_scale, None, None)
    num_experts, inter = _check(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    out = x.new_zeros(num_tokens, x.shape[1])
    if num_tokens == 0:
        return out
    if aligned is None:
        block_m = moe_block_m(num_tokens * top_k, num_experts)
        sorted_ids, tile_experts, _ = moe_align(topk_ids, num_experts, block_m)
    else:
        sorted_ids, tile_experts, block_m = aligned
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    act = x.new_empty(num_tokens * top_k, inter)
    _grouped_matmul(x, w13, act, weights, sorted_ids, tile_experts, top_k, True, False, block_m)
    down = x.new_empty(num_tokens * top_k, x.shape[1])
    _grouped_matmul(act, w2, down, weights, sorted_ids, tile_experts, 1, False, True, block_m)
    return down.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


# ============================================================== reference
def experts_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                      linear: Callable = F.linear) -> torch.Tensor:
    """The torch loop: for each expert hit, gather its tokens, gate/up matmul, silu(gate) * up, down matmul,
    times the routing weight (in its dtype: fp32 for Mixtral), index_add into the output in expert order.

    expert(e) -> (w13 [2I, H], w2 [H, I]) in x's dtype (a quantized model dequantizes expert e here).
    linear: the matmul (the model passes layers/linear.py's CPU-friendly one)."""
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()   # one host sync
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // topk_ids.shape[1]
        w13, w2 = expert(e)
        gate, up = linear(x[tokens], w13).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w2) * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def fused_moe_reference(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe's reference: experts_reference on the same stacked weights (float, int8 or int4), each
    expert dequantized to x's dtype."""
    w13, w2 = _as_weights(w13, w13_scale, None, None), _as_weights(w2, w2_scale, None, None)
    _, inter = _check(x, w13, w2, topk_weights, topk_ids)
    hidden = x.shape[1]
    return experts_reference(x, topk_weights, topk_ids, w13.w.shape[0],
                             lambda e: (w13.dequantized(e, hidden, x.dtype), w2.dequantized(e, inter, x.dtype)))
