"""Shared setup of the Triton kernel tests: the interpreter, dtypes, tolerances, device.

Import it before anything that imports triton (`from kernel_utils import ...` first): without
a GPU the kernels run in Triton's interpreter, which must be chosen before triton decorates
them (importing torch does not import triton). pytest puts tests/ on sys.path (rootdir
conftest), so the plain `from kernel_utils import ...` works from every test file.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Max error allowed, relative to max(1, largest reference magnitude): fp32 kernels accumulate in
# another order than torch; bf16 / fp16 round once at the end where torch rounds after each op.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs error, the error allowed for want's dtype and magnitude)."""
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    scale = want.float().abs().max().item() if want.numel() else 0.0
    return err, TOLERANCE[want.dtype] * max(1.0, scale)


def scattered_pool(seq_lens, num_kv_heads, head_dim, block_size, gen, spare_blocks=3):
    """A NaN-poisoned K/V pool [num_kv_heads, slots, head_dim] (fp32, CPU) in which each sequence's
    blocks sit at random places, its first seq_len slots filled with random keys and values.
    Returns (block_tables [num_seqs, max_blocks] int32 padded with block 0, k_cache, v_cache)."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    k_cache = torch.full((num_kv_heads, num_blocks * block_size, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    start = 0
    for seq, (seq_len, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[seq, :count] = order[start:start + count].int()
        start += count
        positions = torch.arange(seq_len)
        slots = block_tables[seq, positions // block_size].long() * block_size + positions % block_size
        k_cache[:, slots] = torch.randn(num_kv_heads, seq_len, head_dim, generator=gen)
        v_cache[:, slots] = torch.randn(num_kv_heads, seq_len, head_dim, generator=gen)
    return block_tables, k_cache, v_cache
