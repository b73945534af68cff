"""Prefill / extend attention over the paged KV cache: kernel, launcher, reference.

Each sequence brings `num_new` new query tokens (all sequences' tokens concatenated in `q`,
sequence s owning rows `query_start_loc[s]:query_start_loc[s + 1]`) and attends causally to
its `seq_len` keys, the first `seq_len - num_new` of which were cached earlier (prefix caching,
chunked prefill); a full prefill is the case of no cached prefix. The new tokens' keys and
values are already in the pool (store_kv runs first), so every key is read through the block
table: the key at position p sits in slot `block_tables[seq, p // block_size] * block_size +
p % block_size` of the pool `[num_kv_heads, num_slots, head_dim]`. New token i of a sequence
sits at position `seq_len - num_new + i` and sees keys 0..that position.

One kernel, flash-attention style, grid (num_seqs, num_heads, cdiv(max_query_len, BLOCK_M)):
a program takes BLOCK_M new tokens of one sequence for one query head, walks the keys
BLOCK_N at a time with an online softmax in fp32 (exp2), and stops at the tile holding its
last token's diagonal: key tiles entirely above the causal diagonal are never loaded.
Programs past a sequence's new tokens exit at once (the grid is sized for the longest).

Quantized pools (kv_dtype "int8" / "fp8"): the keys and values are read as stored, int8 / fp8
with one fp32 scale per token and KV head (`k_scale`, `v_scale` [num_kv_heads, num_slots]), and
each tile is dequantized in registers (k = k_q.to(fp32) * k_scale[slot]) before the dots
(constexpr KV_QUANT: 0 model-dtype pool, 1 int8, 2 fp8 e4m3). The new tokens are read back from
the cache too, so a prefill attends to the same quantized K/V as the decode steps after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import dequantize_kv
from .paged_decode import LOG2_E, dot_in_fp32
from .softmax import online_softmax_update
from .store_kv import kv_quant_code

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per dtype. fp32 tiles take twice the registers and
# shared memory of 16-bit ones, so fp32 halves the key tile.
EXTEND_LAUNCH = {
    torch.float32: (64, 32, 4, 2),
    torch.bfloat16: (64, 64, 4, 2),
    torch.float16: (64, 64, 4, 2),
}


@triton.jit
def extend_attention_kernel(
    q_ptr,               # [num_tokens, num_heads, head_dim] new queries (strides stride_q_token, stride_q_head)
    k_cache_ptr,         # [num_kv_heads, num_slots, head_dim] key pool (strides stride_cache_head, stride_cache_slot)
    v_cache_ptr,         # [num_kv_heads, num_slots, head_dim] value pool, same strides
    block_tables_ptr,    # [num_seqs, max_blocks] int32, padded with 0 (row stride stride_bt)
    query_start_loc_ptr, # [num_seqs + 1] int32, cumulative new-token counts: seq s owns q rows [qsl[s], qsl[s+1])
    seq_lens_ptr,        # [num_seqs] int32, keys per sequence (cached + new, >= num_new)
    out_ptr,             # [num_tokens, num_heads, head_dim] (strides stride_o_token, stride_o_head)
    k_scale_ptr,         # [num_kv_heads, num_slots] fp32 key scales (KV_QUANT only; row stride stride_scale_head)
    v_scale_ptr,         # [num_kv_heads, num_slots] fp32 value scales (KV_QUANT only)
    stride_q_token, stride_q_head,
    stride_cache_head, stride_cache_slot,
    stride_bt,
    stride_o_token, stride_o_head,
    stride_scale_head,
    scale_log2,          # softmax scale * log2(e): the kernel works in exp2
    head_dim, block_size,
    query_group_size,    # query heads per KV head (num_heads // num_kv_heads): head h reads kv head h // group
    BLOCK_M: tl.constexpr,      # new tokens per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,      # keys per loop step (>= 16; crosses block boundaries: each key looks up its block)
    BLOCK_D: tl.constexpr,      # head_dim rounded up to a power of 2 (80 -> 128, masked)
    DOT_IN_FP32: tl.constexpr,  # exact (ieee) fp32 dots: fp32 inputs (not tf32), and bf16 under the
                                # interpreter, whose tl.dot multiplies bf16's raw uint16 bits
    KV_QUANT: tl.constexpr,     # 0: pools in q's dtype; 1: int8 pools; 2: fp8 e4m3 pools (with scales)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m_start = m_block * BLOCK_M
    # The grid is sized for the longest query of the batch; shorter ones have nothing here.
    if m_start >= num_new:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - num_new

    rows = m_start + tl.arange(0, BLOCK_M)       # index among this sequence's new tokens
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < num_new
    dim_mask = dims < head_dim
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)    # [BLOCK_M, BLOCK_D]
    q_positions = num_cached + rows              # padded rows (past num_new) see keys < key_end: finite, unstored

    # Causal: the tile's last real token sits at position num_cached + min(m_start + BLOCK_M, num_new) - 1,
    # so keys from key_end on are above the diagonal for every row of the tile and are skipped.
    key_end = num_cached + tl.minimum(m_start + BLOCK_M, num_new)
    head_offset = (head // query_group_size).to(tl.int64) * stride_cache_head
    scale_offset = (head // query_group_size).to(tl.int64) * stride_scale_head
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile_start in range(0, key_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        key_mask = positions < key_end
        block_ids = tl.load(bt_row + positions // block_size, mask=key_mask, other=0)
        slots = block_ids.to(tl.int64) * block_size + positions % block_size
        kv_offsets = head_offset + slots[:, None] * stride_cache_slot + dims[None, :]
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)     # [BLOCK_N, BLOCK_D]
        if KV_QUANT:  # dequantize in registers: one scale per key (token) of this KV head
            k_scale = tl.load(k_scale_ptr + scale_offset + slots, mask=key_mask, other=0.0)
            k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
        if DOT_IN_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))                                  # [BLOCK_M, BLOCK_N] fp32
        visible = key_mask[None, :] & (positions[None, :] <= q_positions[:, None])
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)     # [BLOCK_N, BLOCK_D]
        if KV_QUANT:
            v_scale = tl.load(v_scale_ptr + scale_offset + slots, mask=key_mask, other=0.0)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        # Key 0 is visible to every row and lies in the first tile, so row_max is finite from
        # then on, and a row that sees nothing in a later tile gets exp2(-inf) = 0 there.
        row_max, row_sum, acc = online_softmax_update(scores, v, row_max, row_sum, acc, DOT_IN_FP32)

    out = acc / row_sum[:, None]
    o_rows = (q_start + rows).to(tl.int64)
    tl.store(out_ptr + o_rows[:, None] * stride_o_token + head * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, block_size, k_scale=None, v_scale=None):
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"extend_attention wants q [num_tokens, num_heads, head_dim] and pools "
                         f"[num_kv_heads, num_slots, head_dim]; got q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[0]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the pool has {k_cache.shape[2]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_size <= 0 or k_cache.shape[1] % block_size:
        raise ValueError(f"pool of {k_cache.shape[1]} slots is not a whole number of blocks of {block_size}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [num_seqs] int32; got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}] int32 (num_seqs + 1); "
                         f"got {tuple(query_start_loc.shape)} {query_start_loc.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] int32; got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    if q.dtype not in EXTEND_LAUNCH:
        raise ValueError(f"q must be fp32/bf16/fp16; got {q.dtype}")
    kv_quant = kv_quant_code(q.dtype, k_cache, v_cache, k_scale, v_scale, "extend_attention")
    if (q.stride(2) != 1 or k_cache.stride(2) != 1 or k_cache.stride() != v_cache.stride()
            or block_tables.stride(1) != 1 or not query_start_loc.is_contiguous() or not seq_lens.is_contiguous()):
        raise ValueError("extend_attention needs unit stride along head_dim / block table rows, contiguous "
                         "query_start_loc and seq_lens, and pools with identical strides (call .contiguous())")
    return kv_quant


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int,
                     max_query_len: int | None = None, out: torch.Tensor | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim] (into `out` if given).
    int8 / float8_e4m3fn pools: k_scale, v_scale [num_kv_heads, num_slots] fp32 (see store_kv).

    The new tokens' K/V must already be in the pool. query_start_loc[-1] must equal num_tokens
    and num_new <= seq_len <= max_blocks * block_size for every sequence (not checked: that
    would sync with the GPU). max_query_len (the largest num_new) sizes the grid; pass it from
    the host-side batch, or leave None to read it from query_start_loc (a device-to-host sync).
    """
    kv_quant = _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, block_size, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit stride along head_dim; "
                         f"got {tuple(out.shape)} {out.dtype}")
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return out
    block_m, block_n, num_warps, num_stages = EXTEND_LAUNCH[q.dtype]
    extend_attention_kernel[(num_seqs, num_heads, triton.cdiv(max_query_len, block_m))](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        k_scale if kv_quant else out, v_scale if kv_quant else out,  # unused without KV_QUANT
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), k_scale.stride(0) if kv_quant else 0,
        scale * LOG2_E, head_dim, block_size, num_heads // k_cache.shape[0],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_IN_FP32=dot_in_fp32(q.dtype), KV_QUANT=kv_quant, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, block_size: int, max_query_len: int | None = None,
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                               ) -> torch.Tensor:
    """Gather each sequence's keys through its block table, then masked softmax attention (GQA).
    int8 / fp8 pools are dequantized first (q * scale, in fp32)."""
    if k_scale is not None:
        k_cache, v_cache = dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
    group = q.shape[1] // k_cache.shape[0]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        num_new = end - begin
        if num_new == 0:
            continue
        positions = torch.arange(seq_len, device=q.device)
        slots = block_tables[seq, positions // block_size].long() * block_size + positions % block_size
        keys = k_cache[:, slots].float().repeat_interleave(group, dim=0)    # [num_heads, seq_len, head_dim]
        values = v_cache[:, slots].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("qhd,hkd->hqk", q[begin:end].float(), keys) * scale
        q_positions = torch.arange(num_new, device=q.device) + (seq_len - num_new)
        visible = positions[None, :] <= q_positions[:, None]                # [num_new, seq_len]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[begin:end] = torch.einsum("hqk,hkd->qhd", scores.softmax(dim=-1), values).to(q.dtype)
    return out
