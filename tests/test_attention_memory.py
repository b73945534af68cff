"""Attention over a long prompt takes memory linear in its length: no [n, n] mask, no [heads, n, n] scores.

A prompt chunk after cached keys needs a causal mask that SDPA turns into a float [queries, keys] tensor; the
torch reference (which the CPU backend's prefill goes through) runs such a chunk QUERY_TILE queries at a time,
so at 8192 tokens (the default model's context) the largest tensor is one tile's mask, not the whole prompt's.
Memory is measured as the largest tensor any aten op returns (a TorchDispatchMode sees every op SDPA
decomposes into, the math fallback's [heads, n, n] scores included), not timed.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minillm import LLM, SamplingParams
from minillm.layers import attention
from minillm.layers.attention import AttentionMetadata, CPUAttentionBackend, TorchAttentionBackend

N = 8192                      # the default model's context
HEADS, KV_HEADS, DIM = 4, 2, 16


class LargestTensor(TorchDispatchMode):
    """While active: the largest storage (bytes) any aten op returns, and that op's name."""

    def __init__(self):
        super().__init__()
        self.bytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.bytes:
                self.bytes, self.op = t.untyped_storage().nbytes(), str(func)
        return out


def largest_tensor(fn):
    with LargestTensor() as mode:
        out = fn()
    return out, mode.bytes, mode.op


def reference_attention(q, k, v, scale, num_cached):
    """Plain softmax attention with an explicit causal mask, head by head (fp64): q [n, Hq, D], k, v [Hkv, keys, D]."""
    group = q.shape[1] // k.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    q_pos = torch.arange(q.shape[0])[:, None] + num_cached
    hidden = torch.arange(k.shape[1])[None, :] > q_pos
    for h in range(q.shape[1]):
        scores = (q[:, h].double() @ k[h // group].double().T) * scale
        out[:, h] = torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1) @ v[h // group].double()
    return out


def random_qkv(num_q, num_keys, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_q, HEADS, DIM, generator=g), torch.randn(KV_HEADS, num_keys, DIM, generator=g),
            torch.randn(KV_HEADS, num_keys, DIM, generator=g))


@pytest.mark.parametrize("num_cached", [0, N // 2, N - 512, 1])
def test_attention_over_8192_tokens_takes_memory_linear_in_the_context(num_cached):
    q, k, v = random_qkv(N - num_cached, N)
    _, largest, op = largest_tensor(lambda: TorchAttentionBackend().attend(q, k, v, DIM ** -0.5, num_cached))
    one_head_scores = N * N * 4            # a [n, n] fp32 matrix, one head's scores over the whole prompt
    tile_mask = attention.QUERY_TILE * N * 4   # the float mask of one tile of queries over every key
    inputs = max(t.untyped_storage().nbytes() for t in (q, k, v))
    assert largest <= max(tile_mask, inputs), (
        f"num_cached={num_cached}: attention over {N} tokens allocated {largest / 2**20:.0f} MiB in one tensor "
        f"({op}); one tile's mask is {tile_mask / 2**20:.0f} MiB, one head's [n, n] scores "
        f"{one_head_scores / 2**20:.0f} MiB")
    assert largest * 8 <= one_head_scores


def test_the_cpu_backends_prefill_chunk_over_a_long_context_is_tiled():
    """CPUAttentionBackend.extend (the default backend's prefill): the chunk reads its keys from a paged pool."""
    block, num_cached, num_q = 16, N // 2, N // 2
    q, k, v = random_qkv(num_q, N, seed=1)
    meta = AttentionMetadata(query_lens=[num_q], num_cached=[num_cached], slot_mapping=None, block_size=block,
                             block_tables=torch.arange(N // block, dtype=torch.int32)[None].flip(1))
    table = meta.block_tables[0].long()
    slots = (table[:, None] * block + torch.arange(block)).flatten()
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    k_cache[:, slots], v_cache[:, slots] = k, v          # the sequence's keys in reversed blocks
    out, largest, op = largest_tensor(lambda: CPUAttentionBackend().extend(q, k_cache, v_cache, meta, DIM ** -0.5))
    assert largest <= max(attention.QUERY_TILE * N * 4, k.untyped_storage().nbytes()), (
        f"a {num_q}-token chunk after {num_cached} cached tokens allocated {largest / 2**20:.0f} MiB in one tensor "
        f"({op})")
    rows = torch.cat([torch.arange(0, 300), torch.arange(num_q - 300, num_q)])   # the first and last tiles' rows
    want = reference_attention(q[rows[:300]], k[:, :num_cached + 300], v[:, :num_cached + 300], DIM ** -0.5,
                               num_cached)
    assert torch.allclose(out[:300].double(), want, atol=1e-4), float((out[:300] - want).abs().max())
    want = reference_attention(q[-300:], k, v, DIM ** -0.5, num_cached + num_q - 300)
    assert torch.allclose(out[-300:].double(), want, atol=1e-4), float((out[-300:] - want).abs().max())


@pytest.mark.parametrize("tile", [64, 100, 5000])
@pytest.mark.parametrize("num_cached", [1, 37, 256])
def test_tiled_attention_equals_softmax_attention(monkeypatch, tile, num_cached):
    monkeypatch.setattr(attention, "QUERY_TILE", tile)
    q, k, v = random_qkv(300, num_cached + 300, seed=tile + num_cached)
    got = TorchAttentionBackend().attend(q, k, v, 0.3, num_cached)
    want = reference_attention(q, k, v, 0.3, num_cached)
    assert got.shape == q.shape
    assert torch.allclose(got.double(), want, atol=1e-5), (tile, num_cached, float((got - want).abs().max()))


def test_largest_tensor_sees_a_quadratic_score_matrix():
    """The measure itself: SDPA's math fallback materializes [heads, n, n] scores, and LargestTensor sees them."""
    n = 1024
    q, k, v = random_qkv(n, n)
    with sdpa_kernel(SDPBackend.MATH):
        _, largest, op = largest_tensor(lambda: TorchAttentionBackend().attend(q, k, v, 0.25, 0))
    assert largest >= HEADS * n * n * 4, (largest, op)


def test_an_engines_long_prefill_allocates_no_quadratic_tensor():
    """A whole engine on a tiny random model (2 layers, 4 heads): whole-prompt prefill of 1000 tokens, then a
    prompt of 1000 sharing a 256-token cached prefix (a 744-token chunk after cached keys); then both through the
    default chunked prefill. No tensor is larger than one tile's mask (half of one head's [n, n] scores), and the
    tokens agree."""
    n, params = 1000, SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = [(i * 31 + 7) % 500 + 3 for i in range(n)]
    other = prompt[:256] + [(i * 17 + 5) % 500 + 3 for i in range(n - 256)]
    whole = LLM("random:tiny-llama", chunked_prefill=False, prefix_caching=True, max_model_len=1024,
                attention_backend="cpu" if attention.cpu.available() else "torch")
    chunked = whole.with_levers(chunked_prefill=None, prefix_caching=False)
    assert chunked.engine.config.chunked_prefill and chunked.engine.config.max_num_batched_tokens == 512
    results = {}
    for name, llm in (("whole", whole), ("chunked", chunked)):
        outs, largest, op = [], 0, None
        for p in (prompt, other):
            out, size, where = largest_tensor(lambda: llm.generate([{"prompt_token_ids": p}], params))
            outs.append(out[0].outputs[0].token_ids)
            if size > largest:
                largest, op = size, where
        results[name] = outs
        assert largest <= attention.QUERY_TILE * n * 4, (
            f"{name}: {largest} bytes in one tensor ({op}); one tile's mask is {attention.QUERY_TILE * n * 4}")
    assert whole.stats.prefix_cache_hits == 256, "the second prompt's prefix came from the cache"
    assert results["whole"] == results["chunked"], results
