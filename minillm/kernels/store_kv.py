"""Write one step's new keys and values into a layer's paged KV pool: kernel, launcher, reference.

The pool is `[num_kv_heads, num_slots, head_dim]`; token t goes to slot `slot_mapping[t]`.
A slot of -1 means "do not store" (padding tokens of a CUDA-graph batch, for instance).

Quantized pools (kv_dtype "int8" / "fp8", see engine/kv_cache.py): the pool is int8 or
float8_e4m3fn, and each token's head vector is quantized in the kernel as it is written, with
its fp32 scale (max|x| / QMAX) stored in a scale pool `[num_kv_heads, num_slots]` beside it.
The constexpr KV_QUANT picks the variant (0: copy, 1: int8, 2: fp8 e4m3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import AMAX_FLOOR, KV_QMAX, KV_SCALE_DTYPE, quantize_kv

# Pool dtype -> the kernels' KV_QUANT constexpr (a model-dtype pool is 0).
KV_QUANT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
KV_QUANT_NAMES = {1: "int8", 2: "fp8"}
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_INT8_QMAX = tl.constexpr(KV_QMAX["int8"])
_FP8_QMAX = tl.constexpr(KV_QMAX["fp8"])


def kv_quant_code(q_dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale,
                  who: str) -> int:
    """Check a pool against the float dtype of the tensors that meet it; returns KV_QUANT.

    A model-dtype pool takes no scales; an int8 / fp8 pool needs k_scale, v_scale
    [num_kv_heads, num_slots] fp32, contiguous."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{who}: k_cache and v_cache must share a dtype; got {k_cache.dtype} and {v_cache.dtype}")
    code = KV_QUANT_CODES.get(k_cache.dtype, 0)
    if code == 0:
        if k_cache.dtype != q_dtype:
            raise ValueError(f"{who}: the pools are {k_cache.dtype} but the new tensors are {q_dtype}; a pool holds "
                             f"the model dtype, or int8 / float8_e4m3fn with scales")
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{who}: scales are for int8 / fp8 pools; these pools are {k_cache.dtype}")
        return 0
    want = (k_cache.shape[0], k_cache.shape[1])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{who}: a {k_cache.dtype} pool needs {name} [num_kv_heads, num_slots] = {list(want)} "
                             f"{KV_SCALE_DTYPE}")
        if tuple(s.shape) != want or s.dtype != KV_SCALE_DTYPE or not s.is_contiguous():
            raise ValueError(f"{who}: {name} must be {list(want)} {KV_SCALE_DTYPE}, contiguous; "
                             f"got {list(s.shape)} {s.dtype}")
    return code


@triton.jit
def quantize_row(x, KV_QUANT: tl.constexpr):
    """x: [BLOCK_D] one token's head vector (masked lanes 0) -> (q [BLOCK_D] int8 / fp8e4nv, fp32 scale).

    Symmetric absmax, the same arithmetic as engine.kv_cache.quantize_kv: scale = max|x| / QMAX,
    q = round(clamp(x * QMAX / max(max|x|, floor))) (int8 rounds half away from zero, fp8's cast to nearest)."""
    QMAX: tl.constexpr = _INT8_QMAX if KV_QUANT == 1 else _FP8_QMAX
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=0)
    scale = amax / QMAX
    inv = QMAX / tl.maximum(amax, _AMAX_FLOOR)
    y = tl.minimum(tl.maximum(xf * inv, -QMAX), QMAX)
    if KV_QUANT == 1:
        q = tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8)   # fp -> int truncates toward zero
    else:
        # Round to e4m3's grid in fp32 first (nearest even), so the cast is exact: Triton's
        # interpreter casts fp32 -> fp8 without carrying a round-up into the exponent (124.9 -> 64).
        # Normal range (|y| >= 2^-6): keep 3 of fp32's 23 mantissa bits, the carry runs into the exponent.
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576     # -1048576 = ~0xFFFFF
        normal = bits.to(tl.float32, bitcast=True)
        # Subnormal range: multiples of 2^-9 (adding 1.5 * 2^23 rounds to an integer, nearest even).
        subnormal = (tl.abs(y) * 512.0 + 12582912.0 - 12582912.0) * 0.001953125
        subnormal = (subnormal.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # y's sign
        q = tl.where(tl.abs(y) < 0.015625, subnormal, normal).to(tl.float8e4nv)
    return q, scale


@triton.jit
def store_kv_kernel(
    k_ptr,             # [num_tokens, num_kv_heads, head_dim] new keys (row strides stride_k_token, stride_k_head)
    v_ptr,             # [num_tokens, num_kv_heads, head_dim] new values
    k_cache_ptr,       # [num_kv_heads, num_slots, head_dim] key pool (strides stride_cache_head, stride_cache_slot)
    v_cache_ptr,       # [num_kv_heads, num_slots, head_dim] value pool, same strides as the key pool
    slot_mapping_ptr,  # [num_tokens] int64, pool slot of each token; -1 = skip
    k_scale_ptr,       # [num_kv_heads, num_slots] fp32 key scales (KV_QUANT only; row stride stride_scale_head)
    v_scale_ptr,       # [num_kv_heads, num_slots] fp32 value scales (KV_QUANT only)
    stride_k_token, stride_k_head,
    stride_v_token, stride_v_head,
    stride_cache_head, stride_cache_slot,
    stride_scale_head,
    head_dim,
    BLOCK_D: tl.constexpr,   # head_dim rounded up to a power of 2 (80 -> 128, the tail is masked)
    KV_QUANT: tl.constexpr,  # 0: the pool has the model dtype (a copy); 1: int8 pool; 2: fp8 e4m3 pool
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    # A skipped token (slot -1) masks every lane (its row length becomes 0) instead of branching.
    mask = dims < tl.where(slot >= 0, head_dim, 0)
    src_k = k_ptr + token.to(tl.int64) * stride_k_token + kv_head * stride_k_head + dims
    src_v = v_ptr + token.to(tl.int64) * stride_v_token + kv_head * stride_v_head + dims
    dst = kv_head.to(tl.int64) * stride_cache_head + slot * stride_cache_slot + dims
    if KV_QUANT == 0:
        tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)
    else:
        # Masked lanes load 0, which never raises max|x|.
        k_q, k_scale = quantize_row(tl.load(src_k, mask=mask, other=0.0), KV_QUANT)
        v_q, v_scale = quantize_row(tl.load(src_v, mask=mask, other=0.0), KV_QUANT)
        tl.store(k_cache_ptr + dst, k_q, mask=mask)
        tl.store(v_cache_ptr + dst, v_q, mask=mask)
        scale_offset = kv_head.to(tl.int64) * stride_scale_head + slot
        tl.store(k_scale_ptr + scale_offset, k_scale, mask=slot >= 0)
        tl.store(v_scale_ptr + scale_offset, v_scale, mask=slot >= 0)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k_cache, v_cache: [num_kv_heads, num_slots, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] int64 (int32 accepted), -1 skips the token. Writes the pools in place.
    int8 / float8_e4m3fn pools: k_scale, v_scale [num_kv_heads, num_slots] fp32 receive each token's scales."""
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv wants pools [num_kv_heads, num_slots, head_dim] of one shape; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_kv_heads, _, head_dim = k_cache.shape
    if k.dim() != 3 or k.shape[1:] != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"store_kv wants k, v [num_tokens, {num_kv_heads}, {head_dim}] (from the pool); "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"store_kv wants slot_mapping [{k.shape[0]}] int64; "
                         f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if k.dtype != v.dtype:
        raise ValueError(f"store_kv wants one dtype; got k {k.dtype}, v {v.dtype}, pools {k_cache.dtype}/{v_cache.dtype}")
    kv_quant = kv_quant_code(k.dtype, k_cache, v_cache, k_scale, v_scale, "store_kv")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("store_kv needs unit stride along head_dim and pools with identical strides (call .contiguous())")
    if k.shape[0] == 0:
        return
    if kv_quant:
        scale_args = (k_scale, v_scale, k_scale.stride(0))
    else:  # unused by the copy variant: any pointer will do
        scale_args = (k_cache, v_cache, 0)
    store_kv_kernel[(k.shape[0], num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, scale_args[0], scale_args[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), scale_args[2],
        head_dim, BLOCK_D=triton.next_power_of_2(head_dim), KV_QUANT=kv_quant, num_warps=1,
    )


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if k_scale is None:
        k_cache.index_copy_(1, slots, k[keep].transpose(0, 1))
        v_cache.index_copy_(1, slots, v[keep].transpose(0, 1))
        return
    kv_dtype = KV_QUANT_NAMES[KV_QUANT_CODES[k_cache.dtype]]
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        qx, sx = quantize_kv(x[keep], kv_dtype)
        cache.view(torch.uint8).index_copy_(1, slots, qx.view(torch.uint8).transpose(0, 1))
        scales.index_copy_(1, slots, sx.transpose(0, 1))

