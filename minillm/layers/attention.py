"""Attention over the KV cache, through a pluggable backend (torch reference by default).

Batch metadata arrives as one small dataclass (`AttentionMetadata`), built by the model
runner for every step: which slice of the flat token batch belongs to which sequence,
where its new K/V go in the cache (`slot_mapping`) and which cache slots it reads.

A backend is any object with two methods (labs plug a learner's version in here):

    store_kv(k_cache, v_cache, k, v, slot_mapping) -> None
        k_cache, v_cache: [num_kv_heads, num_slots, head_dim]   one layer's pool
        k, v:             [num_tokens, num_kv_heads, head_dim]  this step's new keys/values
        slot_mapping:     [num_tokens] int64                    pool slot of each new token
    attend(q, k, v, scale, num_cached) -> [num_q, num_heads, head_dim]
        q:    [num_q, num_heads, head_dim]   one sequence's new queries
        k, v: [num_kv_heads, num_keys, head_dim]  every key it may see, oldest first
        num_cached: keys before the first query (query i sits at position num_cached + i)

Optional: `decode_batch(q, k_cache, v_cache, read, mask, scale)` serves a whole decode step
in one call (the torch backend has it); a backend without it gets `attend` per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """One step's batch layout. Tokens of all sequences are concatenated (no padding)."""

    query_lens: list[int]                 # new tokens per sequence this step
    num_cached: list[int]                 # tokens already in the cache per sequence
    slot_mapping: torch.Tensor | None     # [num_tokens] pool slot for each new token
    kv_read: list[slice | torch.Tensor] = field(default_factory=list)  # pool slots each sequence reads
    use_cache: bool = True                # False: no cache, attend over this step's keys only
    # Whole-batch layout for kernels that walk block tables (built only for such backends):
    block_size: int = 0
    block_tables: torch.Tensor | None = None     # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor | None = None         # [num_seqs] int32, keys per sequence after this step
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32, offsets of each sequence's queries
    max_query_len: int = 0
    # Decode steps of backends with decode_batch(): every sequence's key slots, padded to one width.
    decode_read: torch.Tensor | None = None      # [num_seqs, max_keys] int64 pool slots (padding repeats a slot)
    decode_mask: torch.Tensor | None = None      # [num_seqs, 1, 1, max_keys] bool, False on the padding


def causal_mask(num_q: int, num_keys: int, num_cached: int, device) -> torch.Tensor:
    """[num_q, num_keys] bool, True where query i (at position num_cached + i) may see key j."""
    q_pos = torch.arange(num_q, device=device).unsqueeze(1) + num_cached
    k_pos = torch.arange(num_keys, device=device).unsqueeze(0)
    return k_pos <= q_pos


class TorchAttentionBackend:
    """The reference backend: index_copy into the pool, scaled_dot_product_attention over it."""

    name = "torch"

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))

    def attend(self, q, k, v, scale, num_cached):
        num_q, num_keys = q.shape[0], k.shape[1]
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

    def decode_batch(self, q, k_cache, v_cache, read, mask, scale):
        """A whole decode step at once. q: [B, Hq, D]; read: [B, L] pool slots; mask: [B, 1, 1, L]
        -> [B, Hq, D]. Padded keys are masked out, so each row equals attend() on its own keys."""
        num_seqs, width = read.shape
        flat = read.flatten()
        k = k_cache.index_select(1, flat).view(k_cache.shape[0], num_seqs, width, -1).transpose(0, 1)
        v = v_cache.index_select(1, flat).view(v_cache.shape[0], num_seqs, width, -1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.squeeze(2)


class TritonAttentionBackend:
    """Triton kernels over the whole batch: store_kv, then paged decode or extend attention.

    On a machine without CUDA the kernels run in Triton's interpreter (slow: for checking
    values, not for speed); the interpreter must be chosen before triton is first imported.
    """

    name = "triton"
    batched = True  # wants the whole batch (block tables) instead of one sequence at a time

    def __init__(self):
        import os
        import sys

        import torch

        if not torch.cuda.is_available():
            if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError("attention_backend='triton' on a CPU needs TRITON_INTERPRET=1 set before triton "
                                   "is imported; start Python with TRITON_INTERPRET=1")
            os.environ["TRITON_INTERPRET"] = "1"
        from ..kernels import extend_attention, paged_decode, store_kv

        self._store_kv = store_kv.store_kv
        self._decode = paged_decode.paged_decode_attention
        self._extend = extend_attention.extend_attention

    def forward_batch(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]."""
        self._store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if meta.max_query_len == 1:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.block_size)
        return self._extend(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                            meta.block_size, max_query_len=meta.max_query_len)


def resolve_backend(backend) -> object:
    if backend == "torch":
        return TorchAttentionBackend()
    if backend == "triton":
        return TritonAttentionBackend()
    return backend


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, reading and writing one layer's pool."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = TorchAttentionBackend()
        # Set by the model runner when the pool is allocated: [num_kv_heads, num_slots, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (T = all sequences' new tokens) -> [T, Hq, D]."""
        if getattr(self.backend, "batched", False):
            return self.backend.forward_batch(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        if meta.use_cache:
            self.backend.store_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        if meta.decode_read is not None and hasattr(self.backend, "decode_batch"):
            return self.backend.decode_batch(q, self.k_cache, self.v_cache, meta.decode_read, meta.decode_mask,
                                             self.scale)
        outs = []
        start = 0
        for i, num_q in enumerate(meta.query_lens):
            end = start + num_q
            if meta.use_cache:
                read = meta.kv_read[i]
                if isinstance(read, slice):
                    k_seq, v_seq = self.k_cache[:, read], self.v_cache[:, read]
                else:  # paged: gather this sequence's slots (index_select is faster than k_cache[:, read])
                    k_seq, v_seq = self.k_cache.index_select(1, read), self.v_cache.index_select(1, read)
                num_cached = meta.num_cached[i]
            else:
                k_seq, v_seq = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
                num_cached = 0
            outs.append(self.backend.attend(q[start:end], k_seq, v_seq, self.scale, num_cached))
            start = end
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
