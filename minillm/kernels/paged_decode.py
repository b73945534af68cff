"""Paged decode attention with split-KV (flash-decoding): kernels, launcher, reference.

One query token per sequence attends to its `seq_len` keys, which live in a paged pool
`[num_kv_heads, num_slots, head_dim]`: the key at position p sits in slot
`block_tables[seq, p // block_size] * block_size + p % block_size`.

Two kernels:
1. `paged_decode_partition_kernel`, grid (num_seqs, num_kv_heads, max_num_partitions): one
   program takes one KV head and one `partition_size` slice of the keys, for all the query
   heads that share that KV head (GQA), packed as the rows of one tile padded to 16 rows so
   `tl.dot` can use tensor cores. It writes the partial output (already divided by its own
   sum), its row max and its sum of exponentials.
2. `paged_decode_reduce_kernel`, grid (num_seqs, num_heads): merges the partitions by
   log-sum-exp weights. Splitting the keys keeps the GPU busy when the batch is small and
   the sequences are long (a few sequences alone would fill a handful of SMs).

Quantized pools (kv_dtype "int8" / "fp8"): the partition kernel reads the int8 / fp8 keys and
values with their per-token-and-head fp32 scales (`k_scale`, `v_scale` [num_kv_heads, num_slots])
and dequantizes each tile in registers, k = k_q.to(fp32) * k_scale[slot], before the dots
(constexpr KV_QUANT: 0 model-dtype pool, 1 int8, 2 fp8 e4m3).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .kv_quant import dequantize_kv
from .softmax import online_softmax_update
from .store_kv import kv_quant_code

LOG2_E = 1.4426950408889634
TILE_N = 64                 # keys per inner-loop step (crosses block boundaries: each key looks up its block)
MIN_DOT_ROWS = 16           # tl.dot needs at least 16 rows; the GQA group is padded up to this
DEFAULT_PARTITION_SIZE = 512
DECODE_NUM_WARPS = 4
REDUCE_NUM_WARPS = 1


def dot_in_fp32(dtype: torch.dtype) -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted)


def padded_group_rows(query_group_size: int) -> int:
    return max(MIN_DOT_ROWS, triton.next_power_of_2(query_group_size))


@triton.jit
def paged_decode_partition_kernel(
    q_ptr,            # [num_seqs, num_heads, head_dim] one query per sequence (strides stride_q_seq, stride_q_head)
    k_cache_ptr,      # [num_kv_heads, num_slots, head_dim] key pool (strides stride_cache_head, stride_cache_slot)
    v_cache_ptr,      # [num_kv_heads, num_slots, head_dim] value pool, same strides
    block_tables_ptr, # [num_seqs, max_blocks] int32, padded with 0 (row stride stride_bt)
    seq_lens_ptr,     # [num_seqs] int32, keys to attend (>= 1, the current token included)
    part_out_ptr,     # [num_seqs, num_heads, max_num_partitions, head_dim] fp32, contiguous
    part_max_ptr,     # [num_seqs, num_heads, max_num_partitions] fp32 row max of the scores, log2 units
    part_sum_ptr,     # [num_seqs, num_heads, max_num_partitions] fp32 sum of exp2(score - max)
    k_scale_ptr,      # [num_kv_heads, num_slots] fp32 key scales (KV_QUANT only; row stride stride_scale_head)
    v_scale_ptr,      # [num_kv_heads, num_slots] fp32 value scales (KV_QUANT only)
    stride_q_seq, stride_q_head,
    stride_cache_head, stride_cache_slot,
    stride_bt,
    stride_scale_head,
    scale_log2,       # softmax scale * log2(e): the kernel works in exp2
    num_heads, head_dim, block_size, partition_size, max_num_partitions,
    QUERY_GROUP_SIZE: tl.constexpr,  # query heads per KV head (num_heads // num_kv_heads)
    GROUP_ROWS: tl.constexpr,        # QUERY_GROUP_SIZE padded to a power of 2 >= 16 (tl.dot minimum)
    BLOCK_D: tl.constexpr,           # head_dim rounded up to a power of 2 (80 -> 128, masked)
    TILE_N: tl.constexpr,            # keys per loop step; partition_size is a multiple of it
    DOT_IN_FP32: tl.constexpr,       # exact (ieee) fp32 dots: fp32 inputs (not tf32), and bf16 under the
                                     # interpreter, whose tl.dot multiplies bf16's raw uint16 bits
    KV_QUANT: tl.constexpr,          # 0: pools in q's dtype; 1: int8 pools; 2: fp8 e4m3 pools (with scales)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = part * partition_size
    # The grid is sized for the longest possible sequence; shorter ones have nothing here,
    # and the reduce kernel never reads these partitions.
    if part_start >= seq_len:
        return
    part_end = tl.minimum(part_start + partition_size, seq_len)

    rows = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < QUERY_GROUP_SIZE
    dim_mask = dims < head_dim
    heads = kv_head * QUERY_GROUP_SIZE + rows
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    head_offset = kv_head.to(tl.int64) * stride_cache_head
    scale_offset = kv_head.to(tl.int64) * stride_scale_head
    row_max = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, BLOCK_D], tl.float32)
    for tile_start in range(part_start, part_end, TILE_N):
        positions = tile_start + tl.arange(0, TILE_N)
        key_mask = positions < part_end
        block_ids = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + positions // block_size,
                            mask=key_mask, other=0)
        slots = block_ids.to(tl.int64) * block_size + positions % block_size
        kv_offsets = head_offset + slots[:, None] * stride_cache_slot + dims[None, :]
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)     # [TILE_N, BLOCK_D]
        if KV_QUANT:  # dequantize in registers: one scale per key (token) of this KV head
            k_scale = tl.load(k_scale_ptr + scale_offset + slots, mask=key_mask, other=0.0)
            k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
        if DOT_IN_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))                                  # [GROUP_ROWS, TILE_N] fp32
        scores = tl.where(key_mask[None, :], scores * scale_log2, float("-inf"))
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)     # [TILE_N, BLOCK_D]
        if KV_QUANT:
            v_scale = tl.load(v_scale_ptr + scale_offset + slots, mask=key_mask, other=0.0)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        # Every tile holds at least one real key (the loop stops at part_end), so the new max is finite.
        row_max, row_sum, acc = online_softmax_update(scores, v, row_max, row_sum, acc, DOT_IN_FP32)

    stat_offsets = (seq * num_heads + heads).to(tl.int64) * max_num_partitions + part
    tl.store(part_max_ptr + stat_offsets, row_max, mask=row_mask)
    tl.store(part_sum_ptr + stat_offsets, row_sum, mask=row_mask)
    out = acc / row_sum[:, None]
    tl.store(part_out_ptr + stat_offsets[:, None] * head_dim + dims[None, :], out,
             mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def paged_decode_reduce_kernel(
    out_ptr,          # [num_seqs, num_heads, head_dim] (strides stride_o_seq, stride_o_head)
    part_out_ptr,     # [num_seqs, num_heads, max_num_partitions, head_dim] fp32, contiguous
    part_max_ptr,     # [num_seqs, num_heads, max_num_partitions] fp32, log2 units
    part_sum_ptr,     # [num_seqs, num_heads, max_num_partitions] fp32
    seq_lens_ptr,     # [num_seqs] int32
    stride_o_seq, stride_o_head,
    num_heads, head_dim, partition_size, max_num_partitions,
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of 2
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_partitions = tl.cdiv(seq_len, partition_size)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    base = (seq * num_heads + head).to(tl.int64) * max_num_partitions
    # Partition 0 always exists (seq_len >= 1); merging the rest one by one keeps every
    # loop-carried value finite.
    total_max = tl.load(part_max_ptr + base)
    total_sum = tl.load(part_sum_ptr + base)
    acc = tl.load(part_out_ptr + base * head_dim + dims, mask=dim_mask, other=0.0) * total_sum
    for part in range(1, num_partitions):
        part_max = tl.load(part_max_ptr + base + part)
        part_sum = tl.load(part_sum_ptr + base + part)
        part_out = tl.load(part_out_ptr + (base + part) * head_dim + dims, mask=dim_mask, other=0.0)
        new_max = tl.maximum(total_max, part_max)
        old_weight = tl.math.exp2(total_max - new_max)
        part_weight = part_sum * tl.math.exp2(part_max - new_max)
        acc = acc * old_weight + part_out * part_weight
        total_sum = total_sum * old_weight + part_weight
        total_max = new_max
    out = acc / total_sum
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _check(q, k_cache, v_cache, block_tables, seq_lens, block_size, partition_size, k_scale=None, v_scale=None):
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode_attention wants q [num_seqs, num_heads, head_dim] and pools "
                         f"[num_kv_heads, num_slots, head_dim]; got q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the pool has {k_cache.shape[2]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.shape[1] % block_size:
        raise ValueError(f"pool of {k_cache.shape[1]} slots is not a whole number of blocks of {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] int32; got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [{num_seqs}] int32; got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be fp32/bf16/fp16; got {q.dtype}")
    kv_quant = kv_quant_code(q.dtype, k_cache, v_cache, k_scale, v_scale, "paged_decode_attention")
    if partition_size <= 0 or partition_size % TILE_N:
        raise ValueError(f"partition_size must be a positive multiple of {TILE_N}; got {partition_size}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or k_cache.stride() != v_cache.stride() or block_tables.stride(1) != 1:
        raise ValueError("paged_decode_attention needs unit stride along head_dim / block table rows and pools "
                         "with identical strides (call .contiguous())")
    return kv_quant


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int,
                           partition_size: int = DEFAULT_PARTITION_SIZE, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim] (written into `out` if given).
    int8 / float8_e4m3fn pools: k_scale, v_scale [num_kv_heads, num_slots] fp32 (see store_kv).

    Every seq_len must be >= 1 and <= max_blocks * block_size (not checked: that would sync
    with the GPU). Nothing here depends on the values of seq_lens, so the launch can be
    captured in a CUDA graph.
    """
    kv_quant = _check(q, k_cache, v_cache, block_tables, seq_lens, block_size, partition_size, k_scale, v_scale)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit stride along head_dim; "
                         f"got {tuple(out.shape)} {out.dtype}")
    if num_seqs == 0:
        return out
    # Upper bound from the table width, not seq_lens.max(): no device-to-host sync.
    max_num_partitions = triton.cdiv(block_tables.shape[1] * block_size, partition_size)
    part_out = torch.empty(num_seqs, num_heads, max_num_partitions, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(num_seqs, num_heads, max_num_partitions, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    block_d = triton.next_power_of_2(head_dim)
    paged_decode_partition_kernel[(num_seqs, num_kv_heads, max_num_partitions)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_max, part_sum,
        k_scale if kv_quant else part_max, v_scale if kv_quant else part_max,  # unused without KV_QUANT
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        k_scale.stride(0) if kv_quant else 0,
        scale * LOG2_E, num_heads, head_dim, block_size, partition_size, max_num_partitions,
        QUERY_GROUP_SIZE=group, GROUP_ROWS=padded_group_rows(group), BLOCK_D=block_d, TILE_N=TILE_N,
        DOT_IN_FP32=dot_in_fp32(q.dtype), KV_QUANT=kv_quant, num_warps=DECODE_NUM_WARPS,
    )
    paged_decode_reduce_kernel[(num_seqs, num_heads)](
        out, part_out, part_max, part_sum, seq_lens, out.stride(0), out.stride(1),
        num_heads, head_dim, partition_size, max_num_partitions, BLOCK_D=block_d, num_warps=REDUCE_NUM_WARPS,
    )
    return out


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                     block_size: int, partition_size: int | None = None,
                                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                                     ) -> torch.Tensor:
    """Gather each sequence's keys through its block table, then plain softmax attention (GQA).
    int8 / fp8 pools are dequantized first (q * scale, in fp32)."""
    if k_scale is not None:
        k_cache, v_cache = dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[0]
    outs = []
    for seq, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len, device=q.device)
        slots = block_tables[seq, positions // block_size].long() * block_size + positions % block_size
        keys = k_cache[:, slots].float().repeat_interleave(group, dim=0)    # [num_heads, seq_len, head_dim]
        values = v_cache[:, slots].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hkd->hk", q[seq].float(), keys) * scale
        outs.append(torch.einsum("hk,hkd->hd", scores.softmax(dim=-1), values))
    return torch.stack(outs).to(q.dtype)
