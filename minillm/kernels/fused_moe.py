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

and a sum over each token's top_k rows gives [T, H]. With WEIGHT_INT8 the expert matrices are int8
with one fp32 scale per output row (quant/int8.py's format, per expert), applied to the accumulator.

No host sync: the launch covers the most tiles the pairs can fill (num_pairs / BLOCK_M + E) and a
tile past the last expert's run (expert id -1) returns at once, so the launch is graph-capturable.

`experts_reference` is the plain torch loop (one matmul pair per expert hit, index_add into the
output), transformers' MixtralExperts / Qwen2MoeExperts order of operations.
"""

from __future__ import annotations

from typing import Callable

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
    b_ptr,             # [E, N or 2N, K] expert weights, float or int8 (strides stride_be, stride_bn; unit along K)
    b_scale_ptr,       # [E, N or 2N] fp32 per-row scales when WEIGHT_INT8 (stride stride_se); unused otherwise
    c_ptr,             # [num_pairs, N] output, one row per pair (row stride stride_cm)
    topk_weights_ptr,  # [num_pairs] fp32 routing weights (read when MUL_ROUTED_WEIGHT)
    sorted_ids_ptr,    # [max_padded] int32 pair ids grouped by expert, each run padded with num_pairs
    tile_experts_ptr,  # [max_tiles] int32 expert of each BLOCK_M tile of sorted_ids, -1 past the last run
    N, K, num_pairs,
    stride_am, stride_be, stride_bn, stride_cm, stride_se,
    A_ROWS_PER: tl.constexpr,         # pairs per activation row: top_k for x, 1 for the per-pair act
    GATED: tl.constexpr,              # rows n and N + n of b are gate and up: output silu(gate) * up
    MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
    WEIGHT_INT8: tl.constexpr,        # b is int8, times b_scale per output row
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
    if WEIGHT_INT8:
        scales = b_scale_ptr + expert.to(tl.int64) * stride_se + cols
        acc = acc * tl.load(scales, mask=col_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scales + N, mask=col_mask, other=0.0)[None, :]
    if GATED:
        if not DOT_IN_FP32:   # the model rounds each projection to its dtype before the activation
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
def _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale):
    if x.dim() != 2 or x.dtype not in ACT_DTYPES:
        raise ValueError(f"fused_moe wants x [num_tokens, hidden] in {ACT_DTYPES}; got {tuple(x.shape)} {x.dtype}")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"fused_moe wants w13 [E, 2 * I, hidden] and w2 [E, hidden, I]; got {tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if x.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not match "
                         "(x [T, H], w13 [E, 2I, H], w2 [E, H, I])")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [num_tokens={x.shape[0]}, top_k]")
    int8 = w13.dtype == torch.int8
    if int8 != (w13_scale is not None) or (w2.dtype == torch.int8) != int8 or (w2_scale is None) == int8:
        raise ValueError("fused_moe: int8 w13 and w2 both need their scales (w13_scale [E, 2I], w2_scale [E, H]); "
                         f"float weights take none (got {w13.dtype}, {w2.dtype})")
    if not int8 and (w13.dtype != x.dtype or w2.dtype != x.dtype):
        raise ValueError(f"fused_moe: float expert weights must have x's dtype {x.dtype}; got {w13.dtype}, {w2.dtype}")
    if int8 and (tuple(w13_scale.shape) != (num_experts, two_i) or tuple(w2_scale.shape) != (num_experts, hidden)):
        raise ValueError(f"fused_moe: w13_scale {tuple(w13_scale.shape)} / w2_scale {tuple(w2_scale.shape)} must be "
                         f"[{num_experts}, {two_i}] / [{num_experts}, {hidden}]")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.stride(2) != 1:
            raise ValueError(f"fused_moe: {name} needs unit stride along its last dimension")


def _grouped_matmul(a, b, b_scale, c, topk_weights, sorted_ids, tile_experts, rows_per, gated, routed, block_m):
    n, k = c.shape[1], b.shape[2]
    block_n, block_k, num_warps, num_stages = MOE_LAUNCH[a.dtype]
    int8 = b.dtype == torch.int8
    grid = (tile_experts.numel(), triton.cdiv(n, block_n))
    fused_moe_kernel[grid](
        a, b, b_scale if int8 else topk_weights, c, topk_weights, sorted_ids, tile_experts,
        n, k, c.shape[0], a.stride(0), b.stride(0), b.stride(1), c.stride(0), b_scale.stride(0) if int8 else 0,
        A_ROWS_PER=rows_per, GATED=gated, MUL_ROUTED_WEIGHT=routed, WEIGHT_INT8=int8,
        DOT_IN_FP32=dot_in_fp32(a.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              aligned: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights [T, k] (fp32),
    topk_ids [T, k] -> sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t]): [T, H] in x's dtype.

    int8 experts: w13 / w2 int8 with w13_scale [E, 2I] / w2_scale [E, H] (W = q * scale[..., None]).
    aligned: moe_align's (sorted_ids, tile_experts) and its block_m, when the caller has them already."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
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
    _grouped_matmul(x, w13, w13_scale, act, weights, sorted_ids, tile_experts, top_k, True, False, block_m)
    down = x.new_empty(num_tokens * top_k, x.shape[1])
    _grouped_matmul(act, w2, w2_scale, down, weights, sorted_ids, tile_experts, 1, False, True, block_m)
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


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe's reference: experts_reference on stacked (or int8 + scales) expert weights."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)

    def expert(e: int):
        if w13_scale is None:
            return w13[e], w2[e]
        return ((w13[e].float() * w13_scale[e, :, None]).to(x.dtype), (w2[e].float() * w2_scale[e, :, None]).to(x.dtype))

    return experts_reference(x, topk_weights, topk_ids, w13.shape[0], expert)
