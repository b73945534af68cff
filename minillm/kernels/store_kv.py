"""Write one step's new keys and values into a layer's paged KV pool: kernel, launcher, reference.

The pool is `[num_kv_heads, num_slots, head_dim]`; token t goes to slot `slot_mapping[t]`.
A slot of -1 means "do not store" (padding tokens of a CUDA-graph batch, for instance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr,             # [num_tokens, num_kv_heads, head_dim] new keys (row strides stride_k_token, stride_k_head)
    v_ptr,             # [num_tokens, num_kv_heads, head_dim] new values
    k_cache_ptr,       # [num_kv_heads, num_slots, head_dim] key pool (strides stride_cache_head, stride_cache_slot)
    v_cache_ptr,       # [num_kv_heads, num_slots, head_dim] value pool, same strides as the key pool
    slot_mapping_ptr,  # [num_tokens] int64, pool slot of each token; -1 = skip
    stride_k_token, stride_k_head,
    stride_v_token, stride_v_head,
    stride_cache_head, stride_cache_slot,
    head_dim,
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of 2 (80 -> 128, the tail is masked)
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
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache, v_cache: [num_kv_heads, num_slots, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] int64 (int32 accepted), -1 skips the token. Writes the pools in place."""
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
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"store_kv wants one dtype; got k {k.dtype}, v {v.dtype}, pools {k_cache.dtype}/{v_cache.dtype}")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("store_kv needs unit stride along head_dim and pools with identical strides (call .contiguous())")
    if k.shape[0] == 0:
        return
    store_kv_kernel[(k.shape[0], num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        head_dim, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1,
    )


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.index_copy_(1, slots, k[keep].transpose(0, 1))
    v_cache.index_copy_(1, slots, v[keep].transpose(0, 1))
