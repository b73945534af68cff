"""KV storage: one pool per layer, [num_kv_heads, num_slots, head_dim] for K and for V.

Slot s of the pool belongs to block s // block_size. Which sequence owns which block is
the block manager's business; this file only sizes and allocates the tensors.
"""

from __future__ import annotations

import torch

from ..models.config import ModelConfig

# Default pool cap: on a laptop 1 GiB of KV is about 23k tokens of SmolLM2-135M in fp32.
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_KV_FRACTION = 0.5


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
               kv_cache_bytes: int | None = None, memory_fraction: float | None = None) -> int:
    """The KV pool size: given in bytes, or as a fraction of free memory, or by default
    enough for `max_num_seqs` full-length sequences capped at 1 GiB (CPU) / half of free GPU memory."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if memory_fraction is not None:
        return int(free_memory_bytes(device) * memory_fraction)
    per_token = cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
    need = per_token * max_num_seqs * max_model_len
    cap = int(free_memory_bytes(device) * DEFAULT_GPU_KV_FRACTION) if device.type == "cuda" else DEFAULT_CPU_KV_BYTES
    return max(min(need, cap), per_token * max_model_len)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.bytes_per_token = cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
        num_slots = num_blocks * block_size
        shape = (cfg.num_kv_heads, num_slots, cfg.head_dim)
        # torch.empty: pages are only touched (and counted by the OS) as tokens are written.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_blocks * self.block_size
