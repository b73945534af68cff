"""Paged KV kernels (store_kv, split-KV paged decode attention) against their torch references.

Pools are scattered: each sequence's blocks are a random permutation of a larger pool, and
every slot no sequence owns (and the tail of each last block) holds NaN, so a kernel that
reads past a sequence or through the wrong block table entry returns NaN, not a near miss.
"""

import pytest
import torch

from kernel_utils import DEVICE, DTYPES, TOLERANCE, scattered_pool  # first: picks the interpreter before triton is imported

from minillm.kernels.paged_decode import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from minillm.kernels.store_kv import store_kv, store_kv_reference


# ---------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(1, 1, 64), (7, 3, 80), (13, 2, 128)])
def test_store_kv_matches_reference_and_skips_slot_minus_one(dtype, num_tokens, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    num_slots = 64
    pool = torch.randn(2, num_kv_heads, num_slots, head_dim, generator=gen).to(dtype)
    # k and v as views into one fused qkv-like tensor: strided rows, as the model produces them.
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = -1  # tokens 0, 3, 6, ... are padding: must not be written anywhere
    pool, fused, slots = pool.to(DEVICE), fused.to(DEVICE), slots.to(DEVICE)
    k, v = fused[:, 0], fused[:, 1]
    got_k, got_v = pool[0].clone(), pool[1].clone()
    want_k, want_v = pool[0].clone(), pool[1].clone()
    store_kv(got_k, got_v, k, v, slots)
    store_kv_reference(want_k, want_v, k, v, slots)
    for name, got, want in (("k_cache", got_k, want_k), ("v_cache", got_v, want_v)):
        diff = (got != want).nonzero()
        assert diff.numel() == 0, (
            f"{name} differs at [head, slot, dim] {diff[0].tolist()} ({len(diff)} elements): "
            f"got {got[tuple(diff[0])].item()}, expected {want[tuple(diff[0])].item()} — "
            "a slot of -1 must be skipped, and each token goes to slot_mapping[token]")


def test_store_kv_rejects_wrong_slot_mapping():
    pool = torch.zeros(2, 32, 64)
    k = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(pool, pool.clone(), k, k, torch.zeros(4, dtype=torch.int64))


# ---------------------------------------------------------------- paged decode attention

def make_paged_batch(seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed, spare_blocks=3):
    """Random q and a NaN-poisoned pool in which each sequence's blocks are scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    block_tables, k_cache, v_cache = scattered_pool(seq_lens, num_kv_heads, head_dim, block_size, gen, spare_blocks)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), block_tables, seq_lens)]


# (head_dim, num_kv_heads, query group size, block_size, seq_lens, partition_size)
PAGED_CASES = [
    pytest.param(64, 2, 1, 16, [1, 5, 100, 500], 128, id="d64-mha-bs16-long"),
    pytest.param(80, 2, 3, 32, [5, 1, 100], 64, id="d80-gqa3-bs32"),
    pytest.param(128, 1, 8, 16, [100, 1, 5], 512, id="d128-gqa8-one-partition"),
    pytest.param(80, 1, 8, 32, [500, 1], 192, id="d80-gqa8-bs32-long"),
    pytest.param(64, 3, 3, 32, [63, 64, 65], 64, id="d64-gqa3-partition-edges"),
    pytest.param(128, 2, 1, 16, [1], 64, id="d128-single-token"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_kv_heads,group,block_size,seq_lens,partition_size", PAGED_CASES)
def test_paged_decode_matches_reference(dtype, head_dim, num_kv_heads, group, block_size, seq_lens, partition_size):
    seed = head_dim * 1000 + group * 100 + block_size + len(seq_lens)
    q, k_cache, v_cache, block_tables, lens = make_paged_batch(seq_lens, num_kv_heads, group, head_dim,
                                                               block_size, dtype, seed)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, block_size,
                                 partition_size=partition_size, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, lens, scale, block_size)
    assert not want.isnan().any(), "the reference read a poisoned slot: the test's block tables are wrong"
    nan = got.isnan().nonzero()
    assert nan.numel() == 0, (
        f"NaN at [seq, head, dim] {nan[0].tolist()} ({len(nan)} elements; seq_len "
        f"{seq_lens[nan[0][0]]}): the kernel read a slot past the sequence or outside its blocks "
        "(check the key mask and the block table lookup), or never wrote this output")
    err = (got.float() - want.float()).abs()
    scale_ref = want.float().abs().max().item()
    tol = TOLERANCE[dtype] * max(1.0, scale_ref)
    if err.max().item() > tol:
        worst = [i.item() for i in torch.unravel_index(err.argmax(), err.shape)]
        seq, head = worst[0], worst[1]
        pytest.fail(f"max error {err.max().item():.3g} > {tol:.3g} at [seq {seq}, head {head}, dim {worst[2]}] "
                    f"(seq_len {seq_lens[seq]}, kv head {head // group}): got {got[tuple(worst)].item():.5g}, "
                    f"expected {want[tuple(worst)].item():.5g} — a wrong kv head for this query head points at "
                    "the GQA grouping, errors only for long sequences at the partition merge")


def test_paged_decode_rejects_bad_partition_size():
    q, k_cache, v_cache, block_tables, lens = make_paged_batch([5], 1, 1, 64, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, 16, partition_size=100)


def test_store_then_decode_matches_torch_backend():
    """The two kernels together reproduce the engine's reference backend for one decode step."""
    from minillm.layers.attention import TorchAttentionBackend

    gen = torch.Generator().manual_seed(7)
    num_kv_heads, group, head_dim, block_size = 2, 3, 80, 16
    seq_len = 37  # the current token is position 36
    k_cache = torch.zeros(num_kv_heads, 8 * block_size, head_dim)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    positions = torch.arange(seq_len)
    slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    store_kv(k_cache, v_cache, k, v, slots)
    q = torch.randn(1, num_kv_heads * group, head_dim, generator=gen)
    got = paged_decode_attention(q, k_cache, v_cache, block_table, torch.tensor([seq_len], dtype=torch.int32),
                                 head_dim ** -0.5, block_size, partition_size=64)
    want = TorchAttentionBackend().attend(q, k.transpose(0, 1), v.transpose(0, 1), head_dim ** -0.5, seq_len - 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
