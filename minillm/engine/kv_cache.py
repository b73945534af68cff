"""KV storage: one pool per layer, [num_kv_heads, num_slots, head_dim] for K and for V.

Slot s of the pool belongs to block s // block_size. Which sequence owns which block is
the block manager's business; this file only sizes and allocates the tensors.

Quantized KV (`kv_dtype="int8"` or `"fp8"`): the pools hold int8 or float8_e4m3fn values, and
beside them one fp32 scale per token and KV head, `[num_kv_heads, num_slots]` per layer for K
and for V. A token's head vector x (head_dim values) is stored as

    scale = max|x| / QMAX          (QMAX = 127 for int8, 448 for e4m3, the largest finite value)
    q     = round(x / scale)       (int8: round half away from zero; fp8: the cast rounds to nearest)
    x    ~= q * scale              (dequantized by whoever reads the cache)

Per token and head (not per tensor) because a new token is written once and never revisited:
its scale is known the moment it is stored, and an outlier in one head of one token does not
spoil the precision of any other. `quantize_kv` / `dequantize_kv` (minillm/kernels/kv_quant.py) are the
torch reference; the Triton store kernel (kernels/store_kv.py) computes the same bits.
"""

from __future__ import annotations

import torch

from ..models.config import ModelConfig
from ..kernels.kv_quant import (AMAX_FLOOR, KV_DTYPES, KV_QMAX, KV_SCALE_DTYPE, KV_STORAGE,  # noqa: F401  re-exported
                       dequantize_kv, kv_quantized, quantize_kv)

# Default pool cap: on a laptop 1 GiB of KV is about 23k tokens of SmolLM2-135M in fp32.
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_KV_FRACTION = 0.5


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_dtype: str | None = None) -> int:
    """Bytes of K and V per token over every layer and KV head, as the pools store them.

    Model dtype: 2 * layers * kv_heads * head_dim * dtype bytes.
    int8 / fp8:  2 * layers * kv_heads * (head_dim * 1 + 4): one byte per value plus one fp32
    scale per head (for head_dim 64 that is 68 bytes per head and token against bf16's 128: 0.53x).
    """
    if not kv_quantized(kv_dtype):
        return cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
    scale_bytes = torch.finfo(KV_SCALE_DTYPE).bits // 8
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * 1 + scale_bytes)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of the device now: the GPU's free bytes, or the OS's available RAM on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pool_bytes(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_num_seqs: int, max_model_len: int,
               kv_cache_bytes: int | None = None, memory_fraction: float | None = None,
               kv_dtype: str | None = None) -> int:
    """The KV pool size: given in bytes, or as a fraction of free memory, or by default
    enough for `max_num_seqs` full-length sequences capped at 1 GiB (CPU) / half of free GPU memory.
    Sized with the per-token bytes as stored (kv_dtype), so int8 KV fits ~2x the tokens of 16-bit."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if memory_fraction is not None:
        return int(free_memory_bytes(device) * memory_fraction)
    per_token = kv_bytes_per_token(cfg, dtype, kv_dtype)
    need = per_token * max_num_seqs * max_model_len
    cap = int(free_memory_bytes(device) * DEFAULT_GPU_KV_FRACTION) if device.type == "cuda" else DEFAULT_CPU_KV_BYTES
    return max(min(need, cap), per_token * max_model_len)


class KVCache:
    """Per layer: k[i], v[i] [num_kv_heads, num_slots, head_dim] in the storage dtype, and for a
    quantized cache k_scale[i], v_scale[i] [num_kv_heads, num_slots] fp32 (None otherwise)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 kv_dtype: str | None = None):
        if kv_quantized(kv_dtype) and kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={kv_dtype!r} is not one of {(None, 'auto') + KV_DTYPES}")
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype                      # the model dtype (what attention computes in)
        self.kv_dtype = kv_dtype if kv_quantized(kv_dtype) else None
        self.storage_dtype = KV_STORAGE[self.kv_dtype] if self.kv_dtype else dtype
        self.bytes_per_token = kv_bytes_per_token(cfg, dtype, self.kv_dtype)
        num_slots = num_blocks * block_size
        shape = (cfg.num_kv_heads, num_slots, cfg.head_dim)
        # torch.empty: pages are only touched (and counted by the OS) as tokens are written.
        self.k = [torch.empty(shape, dtype=self.storage_dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, dtype=self.storage_dtype, device=device) for _ in range(cfg.num_layers)]
        self.k_scale: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * cfg.num_layers
        if self.kv_dtype:
            scale_shape = (cfg.num_kv_heads, num_slots)
            self.k_scale = [torch.empty(scale_shape, dtype=KV_SCALE_DTYPE, device=device) for _ in range(cfg.num_layers)]
            self.v_scale = [torch.empty(scale_shape, dtype=KV_SCALE_DTYPE, device=device) for _ in range(cfg.num_layers)]

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_blocks * self.block_size

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, copy) block's K/V (and scales) into the copy, every layer."""
        if not pairs:
            return
        size = self.block_size
        device = self.k[0].device
        src = torch.tensor([b * size + o for b, _ in pairs for o in range(size)], dtype=torch.long, device=device)
        dst = torch.tensor([b * size + o for _, b in pairs for o in range(size)], dtype=torch.long, device=device)
        for tensors in (self.k, self.v, self.k_scale, self.v_scale):
            for t in tensors:
                if t is not None:
                    t.index_copy_(1, dst, t.index_select(1, src))
