"""Attention over the KV cache, through a pluggable backend (torch reference by default).

Batch metadata arrives as one small dataclass (`AttentionMetadata`), built by the model
runner for every step: which slice of the flat token batch belongs to which sequence,
where its new K/V go in the cache (`slot_mapping`) and which cache slots it reads.

A backend is any object that declares its `layout` and has that layout's methods (the
protocols are in minillm/seams.py; labs plug a learner's version in here):

    layout "sequence"       store_kv(k_cache, v_cache, k, v, slot_mapping); attend(q, k, v, scale, num_cached),
                            called once per sequence with the keys it may see
    layout "padded_decode"  the same, plus decode_padded(q, k_cache, v_cache, read, mask, scale) for a
                            decode step of several sequences (the torch reference)
    layout "block_tables"   store_kv, then decode(q, k_cache, v_cache, meta, scale) or extend(...) over the
                            whole batch, walking block tables in place (the Triton kernels, the CPU kernels)

Named backends: "torch" (the reference), "triton", "cpu" (minillm's CPU kernels, kernels/cpu.py: the
KV store and one-query decode attention in C; prefill and quantized pools through torch) and "auto"
(the default: "cpu" for an fp32 model on the CPU when the kernels are built, else "torch").

Quantized KV (kv_dtype="int8" / "fp8", see engine/kv_cache.py): the pools hold int8 / fp8 and
each layer also has k_scale, v_scale [num_kv_heads, num_slots] fp32. The layer then calls
`store_kv(..., k_scale=, v_scale=)` (and `decode_padded` / `decode` / `extend` with them): the backend
quantizes each new token per head as it writes it. `attend` is unchanged: the layer gathers a
sequence's slots and dequantizes them (K = q * scale, in the model dtype) before calling it.
Every attention reads the cache, a fresh prompt's prefill included: prefill sees the same
quantized K/V as the decode steps after it (vLLM's prefill instead attends over the fresh,
unquantized K/V). This keeps the torch and Triton backends identical, and chunked prefill
equal to whole prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu
from ..kernels.kv_quant import dequantize_kv, quantize_kv
from ..seams import check_attention_backend
from .context import ForwardContext


@dataclass
class AttentionMetadata:
    """One step's batch layout. Tokens of all sequences are concatenated (no padding)."""

    query_lens: list[int]                 # new tokens per sequence this step
    num_cached: list[int]                 # tokens already in the cache per sequence
    slot_mapping: torch.Tensor | None     # [num_tokens] pool slot for each new token
    kv_read: list[slice | torch.Tensor] = field(default_factory=list)  # pool slots each sequence reads
    use_cache: bool = True                # False: no cache, attend over this step's keys only
    # layout "block_tables": the whole batch's tables (built only for such backends).
    block_size: int = 0
    block_tables: torch.Tensor | None = None     # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor | None = None         # [num_seqs] int32, keys per sequence after this step
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32, offsets of each sequence's queries
    max_query_len: int = 0
    # layout "padded_decode", decode steps: every sequence's key slots, padded to one width.
    decode_read: torch.Tensor | None = None      # [num_seqs, max_keys] int64 pool slots (padding repeats a slot)
    decode_mask: torch.Tensor | None = None      # [num_seqs, 1, 1, max_keys] bool, False on the padding


def causal_mask(num_q: int, num_keys: int, num_cached: int, device) -> torch.Tensor:
    """[num_q, num_keys] bool, True where query i (at position num_cached + i) may see key j."""
    q_pos = torch.arange(num_q, device=device).unsqueeze(1) + num_cached
    k_pos = torch.arange(num_keys, device=device).unsqueeze(0)
    return k_pos <= q_pos


# A prompt chunk over cached keys needs a mask (its queries start past key 0); SDPA turns it into a float
# [queries, keys] tensor. Queries go QUERY_TILE at a time, each tile over the keys it may see, so that tensor
# stays [QUERY_TILE, keys]: linear in the context, never [n, n] for a long prompt (SDPA's CPU kernel is
# flash-style: no [heads, queries, keys] scores either). tests/test_attention_memory.py holds the peak.
QUERY_TILE = 512


class TorchAttentionBackend:
    """The reference backend: index_copy into the pool, scaled_dot_product_attention over it."""

    name = "torch"
    layout = "padded_decode"

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
        if k_scale is None:
            k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
            v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))
            return
        # Quantized pools: quantize per token and head, then copy the bytes and the scales.
        kv_dtype = "int8" if k_cache.dtype == torch.int8 else "fp8"
        for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
            qx, sx = quantize_kv(x, kv_dtype)                       # [T, Hkv, D], [T, Hkv]
            # index_copy_ has no fp8 kernel on the CPU: copy the raw bytes instead.
            cache.view(torch.uint8).index_copy_(1, slot_mapping, qx.view(torch.uint8).transpose(0, 1))
            scales.index_copy_(1, slot_mapping, sx.transpose(0, 1))

    def attend(self, q, k, v, scale, num_cached):
        num_q, num_keys = q.shape[0], k.shape[1]
        if 1 < num_q != num_keys and num_q > QUERY_TILE:   # a long chunk after cached keys: tile by tile
            return torch.cat([self.attend(q[a:a + QUERY_TILE], k[:, :num_cached + a + QUERY_TILE],
                                          v[:, :num_cached + a + QUERY_TILE], scale, num_cached + a)
                              for a in range(0, num_q, QUERY_TILE)], dim=0)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, num_q, D]
        kh, vh = k.unsqueeze(0), v.unsqueeze(0)
        if num_q == 1:
            mask, causal = None, False       # one query sees every key before it
        elif num_keys == num_q:
            mask, causal = None, True
        else:
            mask, causal = causal_mask(num_q, num_keys, num_cached, q.device), False
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=qh.shape[1] != kh.shape[1],
        )
        return out.squeeze(0).transpose(0, 1)  # [num_q, H, D]

    def decode_padded(self, q, k_cache, v_cache, read, mask, scale, k_scale=None, v_scale=None):
        """A whole decode step at once. q: [B, Hq, D]; read: [B, L] pool slots; mask: [B, 1, 1, L]
        -> [B, Hq, D]. Padded keys are masked out, so each row equals attend() on its own keys.
        k_scale, v_scale: [Hkv, num_slots] for int8 / fp8 pools (dequantized after the gather)."""
        num_seqs, width = read.shape
        flat = read.flatten()
        k, v = gather_kv(k_cache, v_cache, flat, k_scale, v_scale, q.dtype)    # [Hkv, B * L, D]
        k = k.view(k_cache.shape[0], num_seqs, width, -1).transpose(0, 1)
        v = v.view(v_cache.shape[0], num_seqs, width, -1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.squeeze(2)


_TORCH_BACKEND = TorchAttentionBackend()


def gather_kv(k_cache, v_cache, read, k_scale=None, v_scale=None, dtype=None):
    """One sequence's (or a flat batch's) keys and values: pool slots `read` (a slice or an int64
    tensor) -> k, v [num_kv_heads, num_read, head_dim], dequantized to `dtype` for int8 / fp8 pools."""
    if isinstance(read, slice):
        k, v = k_cache[:, read], v_cache[:, read]
    else:  # paged: gather the slots (index_select is faster than k_cache[:, read])
        k, v = k_cache.index_select(1, read), v_cache.index_select(1, read)
    if k_scale is None:
        return k, v
    ks, vs = (k_scale[:, read], v_scale[:, read]) if isinstance(read, slice) else \
        (k_scale.index_select(1, read), v_scale.index_select(1, read))
    return dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype)


class TritonAttentionBackend:
    """Triton kernels over the whole batch: store_kv, then paged decode or extend attention.

    On a machine without CUDA the kernels run in Triton's interpreter (slow: for checking
    values, not for speed); the interpreter must be chosen before triton is first imported.
    """

    name = "triton"
    layout = "block_tables"

    def __init__(self, kv_dtype: str | None = None, device: torch.device | None = None):
        import os
        import sys

        if device is not None and device.type == "cuda" and kv_dtype == "fp8":
            from ..hardware import gpu_capability, missing_gpu_feature, sm_name

            capability = gpu_capability(device)
            lacks_fp8 = missing_gpu_feature(capability, "fp8")
            if lacks_fp8:
                raise ValueError(f"kv_dtype='fp8' with attention_backend='triton' on {sm_name(capability)}: "
                                 f"{lacks_fp8}. Use kv_dtype='int8', or attention_backend='torch'.")
        if not torch.cuda.is_available():
            if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError("attention_backend='triton' on a CPU needs TRITON_INTERPRET=1 set before triton "
                                   "is imported; start Python with TRITON_INTERPRET=1")
            os.environ["TRITON_INTERPRET"] = "1"
        from ..kernels import extend_attention, paged_decode, store_kv

        self._store_kv = store_kv.store_kv
        self._decode = paged_decode.paged_decode_attention
        self._extend = extend_attention.extend_attention

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None) -> None:
        """k_scale, v_scale: [Hkv, num_slots] fp32 for int8 / fp8 pools (the kernel quantizes as it stores)."""
        self._store_kv(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None):
        return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.block_size,
                            k_scale=k_scale, v_scale=v_scale)

    def extend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None):
        return self._extend(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                            meta.block_size, max_query_len=meta.max_query_len, k_scale=k_scale, v_scale=v_scale)


class CPUAttentionBackend:
    """minillm's CPU kernels over the whole batch (kernels/cpu.py): the KV store and decode attention
    (one query per sequence, walking its block table) in C, one call per layer each. Prefill chunks
    (extend) and int8 / fp8 pools go through the torch reference, one sequence at a time."""

    name = "cpu"
    layout = "block_tables"

    def __init__(self):
        self.torch = TorchAttentionBackend()

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None) -> None:
        if k_scale is not None or k_cache.dtype != torch.float32:
            return self.torch.store_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
        cpu.store_kv(k_cache, v_cache, k, v, slot_mapping, check_ranges=False)   # the engine's slots

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None):
        if k_scale is not None or k_cache.dtype != torch.float32:
            return self.extend(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
        max_len = max(c + n for c, n in zip(meta.num_cached, meta.query_lens))
        return cpu.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.block_size, scale,
                                    max_len=max_len)

    def extend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None):
        outs, start = [], 0
        offsets = torch.arange(meta.block_size)
        for i, (num_q, cached) in enumerate(zip(meta.query_lens, meta.num_cached)):
            keys = cached + num_q
            blocks = -(-keys // meta.block_size)
            slots = (meta.block_tables[i, :blocks, None].long() * meta.block_size + offsets).flatten()[:keys]
            k, v = gather_kv(k_cache, v_cache, slots, k_scale, v_scale, q.dtype)
            outs.append(self.torch.attend(q[start:start + num_q], k, v, scale, cached))
            start += num_q
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def cpu_kernels_fit(device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether attention_backend="auto" picks "cpu": an fp32 model on the CPU, with the kernels built."""
    return (device is None or device.type == "cpu") and dtype in (None, torch.float32) and cpu.available()


def resolve_backend(backend, kv_dtype: str | None = None, device: torch.device | None = None,
                    dtype: torch.dtype | None = None):
    """A backend object for "torch" / "triton" / "cpu" / "auto" (the Triton one refuses fp8 KV on cards
    without fp8; "cpu" needs an fp32 model on the CPU and the kernels built); any other object is
    checked against its layout's protocol (minillm/seams.py)."""
    if backend == "auto":
        backend = "cpu" if cpu_kernels_fit(device, dtype) else "torch"
    if backend == "torch":
        return TorchAttentionBackend()
    if backend == "triton":
        return TritonAttentionBackend(kv_dtype, device)
    if backend == "cpu":
        if not cpu_kernels_fit(device, dtype):
            reason = cpu.unavailable_reason() or f"they take fp32 models on the CPU, not {dtype} on {device}"
            raise ValueError(f"attention_backend='cpu' cannot run here: {reason}. Use 'torch' (or 'auto').")
        return CPUAttentionBackend()
    return check_attention_backend(backend)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, reading and writing layer `layer_index`'s pool.

    The module holds no state: the pool, the backend and the batch layout come with each pass's
    ForwardContext (layers/context.py), so engines that share the weights each bring their own."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_index: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_index = layer_index
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v, ctx: ForwardContext | AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (T = all sequences' new tokens) -> [T, Hq, D]. An AttentionMetadata
        alone: a pass without a pool (use_cache=False), through the torch reference."""
        ctx = ForwardContext.of(ctx)
        meta = ctx.meta
        backend = ctx.backend if ctx.backend is not None else _TORCH_BACKEND
        if not meta.use_cache:
            if backend.layout == "block_tables":
                backend = _TORCH_BACKEND   # no pool to walk (a whole-sequence pass: calibration, perplexity)
            return _attend_each(backend, q, meta, self.scale,
                                lambda i, start, end: (k[start:end].transpose(0, 1), v[start:end].transpose(0, 1), 0))
        k_cache, v_cache, k_scale, v_scale = ctx.kv_layer(self.layer_index)
        # Scales go to the backend only for a quantized pool, so backends that know nothing of
        # them (a lab's) keep their signatures.
        quant = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        backend.store_kv(k_cache, v_cache, k, v, meta.slot_mapping, **quant)
        if backend.layout == "block_tables":
            attend = backend.decode if meta.max_query_len == 1 else backend.extend
            return attend(q, k_cache, v_cache, meta, self.scale, **quant)
        if meta.decode_read is not None:   # layout "padded_decode", a decode step of several sequences
            return backend.decode_padded(q, k_cache, v_cache, meta.decode_read, meta.decode_mask, self.scale, **quant)

        def cached(i, start, end):
            k_seq, v_seq = gather_kv(k_cache, v_cache, meta.kv_read[i], k_scale, v_scale, q.dtype)
            return k_seq, v_seq, meta.num_cached[i]
        return _attend_each(backend, q, meta, self.scale, cached)


def _attend_each(backend, q, meta: AttentionMetadata, scale: float, keys) -> torch.Tensor:
    """backend.attend once per sequence; keys(i, start, end) -> (k, v, num_cached) of sequence i."""
    outs = []
    start = 0
    for i, num_q in enumerate(meta.query_lens):
        end = start + num_q
        k_seq, v_seq, num_cached = keys(i, start, end)
        outs.append(backend.attend(q[start:end], k_seq, v_seq, scale, num_cached))
        start = end
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
