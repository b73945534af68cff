"""torch's int4 CPU kernel and its private weight layout ("int4pack"), in one place.

`aten._weight_int4pack_mm_for_cpu` multiplies bf16 activations by int4 weights that
`aten._convert_weight_to_int4pack_for_cpu(q, 1)` packed into its own layout. Neither is public
API, so everything that writes, multiplies or reads that layout is here; Int4Linear's "int4pack"
path calls these functions, and tests/test_int4pack.py checks them against the plain layout
(minillm/quant/int4.py) on fresh random weights.

The layout (torch's int4mm_kernel.cpp, innerKTiles=1): rows in blocks of BLOCK_N (32 on AVX2
builds and CPUs, 64 on AVX-512); a full block's bytes are [K, BLOCK_N/2], byte (k, j) holding row
j's level in its low nibble and row j + BLOCK_N/2's in its high nibble. A last block of fewer rows
(N % BLOCK_N of them) is [K, rows/2] with rows 2i and 2i + 1 in byte i. The kernel computes
w = (q - 8) * scale + zero8 per group, so zero8 = zero + 8 * scale for the plain zero.

block_n() probes which BLOCK_N this build and CPU pack with (0: neither, so callers fall back to
recover(), which reads the layout through the kernel itself and needs no knowledge of it).
"""

from __future__ import annotations

import torch

from .int4 import pack_int4

BLOCK_NS = (32, 64)
_BLOCK_N: list[int] = []


def available() -> bool:
    """Whether this torch build has the int4 CPU kernel and its packer."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain levels q [N, Kp] in 0..15 and bf16 scale, zero [N, Kp/g] -> (packed [N, Kp/2] in the
    kernel's layout, scales_and_zeros bf16 [Kp/g, N, 2] holding (scale, zero8))."""
    zero8 = (zero.float() + 8 * scale.float()).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    return packed, torch.stack([scale, zero8], dim=-1).transpose(0, 1).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, Kp] (bf16 for the fast kernel) @ W^T -> [M, N]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def gather(packed: torch.Tensor, ids: torch.Tensor, k: int, block_n: int) -> torch.Tensor:
    """Levels q uint8 [T, k] of rows ids from a packed buffer [N, k/2] packed in blocks of block_n."""
    n = packed.shape[0]
    flat = packed.reshape(-1)
    full = n // block_n * block_n                                   # rows in full blocks
    half, tail = block_n // 2, n - full
    kk = torch.arange(k)
    j = ids % block_n
    in_block = (ids // block_n * (k * half) + (j % half))[:, None] + kk * half           # [T, K]
    r = (ids - full).clamp(min=0)
    in_tail = (full * k // 2 + r // 2)[:, None] + kk * max(tail // 2, 1)                  # [T, K]
    is_tail = (ids >= full)[:, None]
    byte = flat[torch.where(is_tail, in_tail, in_block)]
    shift = torch.where(ids >= full, 4 * (r % 2), 4 * (j // half)).to(torch.uint8)
    return (byte >> shift[:, None]) & 0x0F


def block_n() -> int:
    """The row block (32 or 64) this torch build's packer uses on this CPU, checked by packing random
    levels (full blocks and a short last block) and gathering them back; 0 if the layout is neither
    (probed once)."""
    if not _BLOCK_N:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (176, 64), generator=g, dtype=torch.int32)  # 5 x 32 + 16 and 2 x 64 + 48
        ids = torch.arange(q.shape[0])
        found = 0
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            if tuple(packed.shape) == (q.shape[0], 32):
                found = next((b for b in BLOCK_NS if torch.equal(gather(packed, ids, 64, b).int(), q)), 0)
        except (RuntimeError, AttributeError):
            pass
        _BLOCK_N.append(found)
    return _BLOCK_N[0]


def rows(packed: torch.Tensor, scales_and_zeros: torch.Tensor, ids: torch.Tensor, k: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Plain (q uint8 [T, k], scale fp32 [T, k/g], zero fp32 [T, k/g]) of rows ids (1-D), read straight
    from the packed buffers; None when block_n() does not know this build's layout."""
    block = block_n()
    if not block:
        return None
    sz = scales_and_zeros[:, ids].float()  # [K/g, T, 2]
    scale = sz[..., 0].t()
    return gather(packed, ids, k, block), scale, sz[..., 1].t() - 8 * scale  # the plain zero, as recover() computes it


def recover(packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int, k: int, group_size: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain layout (pack_int4'd q uint8 [N, k/2], scale fp32 [N, k/g], zero fp32 [N, k/g]) of
    packed buffers, through the kernel alone. Given fp32 scales and zeros the kernel computes
    w = (q - 8) * scale + zero8 in fp32, so multiplying the identity returns each w in fp32, and
    q = round((w - zero8) / scale) + 8 is exact (|w - zero8| / scale <= 8, far inside fp32's precision).
    The plain zero is zero8 - 8 * scale (in fp32)."""
    g = group_size
    sz = scales_and_zeros.float()  # [K/g, N, 2]
    scale = sz[..., 0].t().contiguous()  # [N, K/g]
    zero8 = sz[..., 1].t().contiguous()  # [N, K/g]
    q = torch.empty(n, k, dtype=torch.uint8)
    chunk = max(g, (1 << 22) // max(k, 1) // g * g)  # identity blocks of at most ~4M entries
    for start in range(0, k, chunk):
        stop = min(k, start + chunk)
        eye = torch.zeros(stop - start, k)
        eye[:, start:stop] = torch.eye(stop - start)
        w = matmul(eye, packed, g, sz).t()  # [N, stop - start]
        groups = torch.arange(start, stop) // g
        level = torch.round((w - zero8[:, groups]) / scale[:, groups]) + 8
        q[:, start:stop] = level.clamp_(0, 15).to(torch.uint8)
    return pack_int4(q), scale, zero8 - 8 * scale
