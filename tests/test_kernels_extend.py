"""Prefill / extend attention over the paged cache against its torch reference.

Batches mix full prefills (no cached prefix), extends with a cached prefix (prefix caching,
chunked prefill) and single-token rows, concatenated in one q as the engine builds them.
Pools are scattered: each sequence's blocks are a random permutation of a larger pool, and
every slot no sequence owns (and the tail of each last block) holds NaN, so a kernel that
reads past a sequence, above the causal diagonal's last tile, or through the wrong block
table entry returns NaN, not a near miss. The output starts as NaN: every row must be written.
"""

import pytest
import torch

from kernel_utils import DEVICE, DTYPES, TOLERANCE, scattered_pool  # first: picks the interpreter before triton is imported

from minillm.kernels.extend_attention import (
    extend_attention,
    extend_attention_reference,
)
from minillm.kernels.store_kv import store_kv


def make_extend_batch(rows, num_kv_heads, group, head_dim, block_size, dtype, seed, spare_blocks=3):
    """rows: [(num_cached, num_new)] per sequence. Random q for the new tokens and a NaN-poisoned
    pool holding every sequence's cached + new keys in randomly scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in rows]
    block_tables, k_cache, v_cache = scattered_pool(seq_lens, num_kv_heads, head_dim, block_size, gen, spare_blocks)
    num_new = torch.tensor([new for _, new in rows], dtype=torch.int32)
    query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
    query_start_loc[1:] = num_new.cumsum(0)
    q = torch.randn(int(num_new.sum()), num_kv_heads * group, head_dim, generator=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), block_tables,
                                   query_start_loc, seq_lens)]


# (head_dim, num_kv_heads, query group size, block_size, [(num_cached, num_new)] per sequence)
EXTEND_CASES = [
    pytest.param(64, 2, 1, 16, [(0, 1), (0, 5), (0, 100), (37, 20), (40, 1)], id="d64-mha-bs16-mixed"),
    pytest.param(80, 1, 3, 32, [(37, 20), (0, 100), (63, 1), (0, 5)], id="d80-gqa3-bs32-mixed"),
    pytest.param(128, 1, 8, 16, [(0, 5), (37, 20), (0, 1), (10, 1)], id="d128-gqa8-bs16-mixed"),
    pytest.param(80, 1, 3, 16, [(430, 70), (0, 1)], id="d80-gqa3-long-500"),
    pytest.param(64, 1, 8, 32, [(0, 500), (7, 3)], id="d64-gqa8-bs32-prefill-500"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_kv_heads,group,block_size,rows", EXTEND_CASES)
def test_extend_attention_matches_reference(dtype, head_dim, num_kv_heads, group, block_size, rows):
    seed = head_dim * 1000 + group * 100 + block_size + len(rows)
    q, k_cache, v_cache, block_tables, qsl, lens = make_extend_batch(rows, num_kv_heads, group, head_dim,
                                                                     block_size, dtype, seed)
    scale = head_dim ** -0.5
    max_query_len = max(new for _, new in rows)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = extend_attention(q, k_cache, v_cache, block_tables, qsl, lens, scale, block_size,
                           max_query_len=max_query_len, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = extend_attention_reference(q, k_cache, v_cache, block_tables, qsl, lens, scale, block_size)
    assert not want.isnan().any(), "the reference read a poisoned slot: the test's block tables are wrong"
    token_seq = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([new for _, new in rows]))

    def where(token):
        seq = token_seq[token].item()
        cached, new = rows[seq]
        i = token - qsl[seq].item()
        return f"seq {seq} (cached {cached}, new {new}), new token {i} at position {cached + i}"

    nan = got.isnan().nonzero()
    assert nan.numel() == 0, (
        f"NaN at [token, head, dim] {nan[0].tolist()} ({len(nan)} elements; {where(nan[0][0].item())}): the "
        "kernel read a slot past the sequence or outside its blocks (check the key mask, the causal tile "
        "bound and the block table lookup), or never wrote this output row")
    err = (got.float() - want.float()).abs()
    tol = TOLERANCE[dtype] * max(1.0, want.float().abs().max().item())
    if err.max().item() > tol:
        token, head, dim = [i.item() for i in torch.unravel_index(err.argmax(), err.shape)]
        pytest.fail(f"max error {err.max().item():.3g} > {tol:.3g} at [token {token}, head {head}, dim {dim}] "
                    f"({where(token)}, kv head {head // group}): got {got[token, head, dim].item():.5g}, "
                    f"expected {want[token, head, dim].item():.5g} — errors only in extend rows point at the "
                    "causal offset (num_cached), only for some heads at the GQA grouping")


def test_store_then_prefill_matches_sdpa():
    """store_kv + extend_attention reproduce plain causal attention for a prefill and its continuation."""
    gen = torch.Generator().manual_seed(11)
    num_kv_heads, group, head_dim, block_size, total, chunk = 2, 3, 64, 16, 45, 29
    k_cache = torch.zeros(num_kv_heads, 6 * block_size, head_dim)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[4, 1, 5]], dtype=torch.int32)
    positions = torch.arange(total)
    slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
    q = torch.randn(total, num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0), v.transpose(0, 1).repeat_interleave(group, 0),
        is_causal=True, scale=head_dim ** -0.5).transpose(0, 1)
    got = torch.empty_like(q)
    # Chunked prefill: the first `chunk` tokens, then the rest over the cached prefix.
    for begin, end in ((0, chunk), (chunk, total)):
        store_kv(k_cache, v_cache, k[begin:end], v[begin:end], slots[begin:end])
        qsl = torch.tensor([0, end - begin], dtype=torch.int32)
        got[begin:end] = extend_attention(q[begin:end], k_cache, v_cache, block_table, qsl,
                                          torch.tensor([end], dtype=torch.int32), head_dim ** -0.5, block_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_extend_attention_rejects_bad_query_start_loc():
    q, k_cache, v_cache, block_tables, qsl, lens = make_extend_batch([(0, 5)], 1, 1, 64, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="query_start_loc"):
        extend_attention(q, k_cache, v_cache, block_tables, qsl.long(), lens, 0.125, 16)
