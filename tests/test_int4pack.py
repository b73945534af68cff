"""torch's int4 CPU layout ("int4pack", minillm/quant/int4pack.py): written by torch's packer,
read back by gather / rows / recover, each checked against the plain layout (minillm/quant/int4.py)."""

import pytest
import torch

from minillm.quant import int4pack
from minillm.quant.int4 import dequantize_int4, pack_int4, quantize_int4

needs_kernel = pytest.mark.skipif(not int4pack.available(), reason="this torch build has no int4 CPU kernel")


def int4pack_like_torch(q: torch.Tensor, block_n: int) -> torch.Tensor:
    """What aten._convert_weight_to_int4pack_for_cpu(q, 1) stores on a CPU whose vectors pack rows in
    blocks of block_n (torch's int4mm_kernel.cpp): per full block, byte (k, j) = row j | row j + block_n/2
    << 4 (AVX2: 32; AVX-512: 64); a last, shorter block of rows holds rows 2i | 2i + 1 << 4 in byte i."""
    n, k = q.shape
    out = []
    for start in range(0, n, block_n):
        rows = q[start:start + block_n].to(torch.uint8)                   # [b, K]
        b = rows.shape[0]
        lo, hi = (rows[: b // 2], rows[b // 2:]) if b == block_n else (rows[0::2], rows[1::2])
        out.append((lo | (hi << 4)).t().reshape(-1))                   # [K, b/2] flattened
    return torch.cat(out).reshape(n, k // 2)


@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("n", [64, 96, 176, 16])
def test_int4pack_gather_reads_both_cpu_layouts(block_n, n):
    """rows() reads the CPU kernel's packed int4 on AVX2 (blocks of 32) and AVX-512 (64) machines alike,
    the short last block included; the layout this machine's torch uses is checked against torch itself."""
    g = torch.Generator().manual_seed(n * block_n)
    q = torch.randint(0, 16, (n, 48), generator=g, dtype=torch.int32)
    ids = torch.randperm(n, generator=g)[: min(n, 20)]
    packed = int4pack_like_torch(q, block_n)
    assert torch.equal(int4pack.gather(packed, ids, 48, block_n).int(), q[ids])
    if hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu") and int4pack.block_n() == block_n:
        assert torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), packed)


@needs_kernel
@pytest.mark.parametrize("n, k, group", [(48, 128, 32), (176, 256, 64), (80, 384, 128)])
def test_int4pack_reads_back_the_plain_layout_on_fresh_random_weights(n, k, group):
    """pack() then recover() and rows() give the plain levels and scales exactly; the plain zero is
    the kernel's zero8 - 8 * scale, the same matrix the kernel multiplies by."""
    g = torch.Generator().manual_seed(n + k + group)
    w = torch.randn(n, k, generator=g)
    w[1] += 2.0  # a row far from zero: its groups' zeros are large next to their scales
    q, scale, zero = quantize_int4(w, group)
    scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
    packed, scales_and_zeros = int4pack.pack(q, scale, zero)
    plain, scale_back, zero_back = int4pack.recover(packed, scales_and_zeros, n, k, group)
    assert torch.equal(plain, pack_int4(q)) and torch.equal(scale_back, scale.float())
    torch.testing.assert_close(zero_back, zero.float(), rtol=0, atol=float(8 * scale.float().max()) * 2 ** -7)
    kernel = int4pack.matmul(torch.eye(k), packed, group, scales_and_zeros.float()).t()
    torch.testing.assert_close(dequantize_int4(q, scale_back, zero_back), kernel)
    if int4pack.block_n():
        ids = torch.randperm(n, generator=g)[:20]
        q_rows, scale_rows, zero_rows = int4pack.rows(packed, scales_and_zeros, ids, k)
        assert torch.equal(q_rows, q[ids]) and torch.equal(scale_rows, scale_back[ids])
        assert torch.equal(zero_rows, zero_back[ids])
