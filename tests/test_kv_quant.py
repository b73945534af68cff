"""Quantized KV cache (kv_dtype="int8" / "fp8"): one byte per value plus one fp32 scale per token
and KV head. Round-trip error bounds, the Triton store kernel against the torch reference, the
paged decode and extend attention kernels reading int8 / fp8 pools against a torch reference that
dequantizes, and the engine: greedy outputs close to the unquantized cache's, bytes per token,
pool capacity, every block back in the pool."""

from __future__ import annotations

import random

import pytest
import torch

import kernel_utils  # noqa: F401  first: picks the Triton interpreter before triton is imported
from conftest import assert_engine_idle, tokenizer_files
from kernel_utils import DEVICE, DTYPES, TOLERANCE, max_error, quantized_pools, scattered_pool
from test_models import BASE

from minillm import LLM, EngineConfig, SamplingParams
from minillm.engine.kv_cache import (KV_QMAX, KV_STORAGE, KVCache, dequantize_kv, kv_bytes_per_token, pool_bytes,
                                     quantize_kv)

KV_DTYPES = ["int8", "fp8"]
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL = 2.0 ** -6       # below it e4m3 is subnormal: a fixed spacing of 2^-9
E4M3_SUBNORMAL_STEP = 2.0 ** -9


# ---------------------------------------------------------------- quantize / dequantize

def _samples(gen):
    """[tokens, heads, head_dim] fp32 with a spread of magnitudes per head, an all-zero head, an outlier."""
    x = torch.randn(64, 3, 80, generator=gen) * torch.exp(torch.randn(64, 3, 1, generator=gen) * 2)
    x[5, 1] = 0.0
    x[7, 2, 11] = 1e4
    return x


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantize_round_trip_error_bound_per_token_and_head(kv_dtype):
    x = _samples(torch.Generator().manual_seed(0))
    q, scale = quantize_kv(x, kv_dtype)
    assert q.dtype == KV_STORAGE[kv_dtype] and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    amax = x.abs().amax(dim=-1)
    torch.testing.assert_close(scale, amax / KV_QMAX[kv_dtype], rtol=1e-6, atol=0)
    # The largest value of each head maps to +-QMAX exactly.
    assert (q.float().abs().amax(dim=-1)[amax > 0] == KV_QMAX[kv_dtype]).all()
    back = dequantize_kv(q, scale)
    err = (back - x).abs()
    s = scale.unsqueeze(-1)
    if kv_dtype == "int8":
        bound = s / 2 * (1 + 1e-5) + 1e-30                # round to nearest: half a step of `scale`
    else:
        # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 for normal values, and half a
        # subnormal step (2^-10, in units of scale) below 2^-6.
        bound = torch.maximum(x.abs() * 2.0 ** -(E4M3_MANTISSA_BITS + 1), s * E4M3_SUBNORMAL_STEP / 2) * (1 + 1e-5)
    worst = (err - bound).max()
    assert worst <= 0, f"{kv_dtype}: round-trip error exceeds the bound by {worst.item():.3g}"
    assert (back[5, 1] == 0).all() and (scale[5, 1] == 0), "an all-zero head stores zeros with scale 0"
    # The error is far below the signal (per-head relative RMS error), except in the head with the
    # outlier, whose scale the outlier sets: that precision loss stays inside that one token and head.
    rel = err.pow(2).mean(-1).sqrt() / x.pow(2).mean(-1).sqrt().clamp(min=1e-30)
    typical = (amax > 0) & (torch.arange(64)[:, None] != 7)
    assert rel[typical].max() < (0.01 if kv_dtype == "int8" else 0.06), rel[typical].max()
    if kv_dtype == "int8":   # a uniform grid: the outlier's step swamps its head's small values
        assert rel[7, 2] > 2 * rel[typical].median()
    else:                    # a float grid keeps small values' relative precision (down to 2^-6 * scale)
        assert rel[7, 2] < 0.06


def test_quantize_kv_handles_16_bit_inputs():
    x = _samples(torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.clamp(-6e4, 6e4).to(dtype)
        q, scale = quantize_kv(xd, "int8")
        err = (dequantize_kv(q, scale) - xd.float()).abs()
        assert (err <= scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
        assert dequantize_kv(q, scale, dtype).dtype == dtype


# ---------------------------------------------------------------- storage and sizing

def _cfg(**overrides):
    from minillm.models.presets import PRESETS

    import dataclasses
    return dataclasses.replace(PRESETS["smollm2-135m"], **overrides)


def test_bytes_per_token_counts_values_and_scales():
    cfg = _cfg()  # 30 layers, 3 KV heads, head_dim 64
    layers, heads, dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    bf16 = 2 * layers * heads * dim * 2
    assert kv_bytes_per_token(cfg, torch.bfloat16) == bf16 == 23040
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * bf16
    for kv_dtype in KV_DTYPES:
        got = kv_bytes_per_token(cfg, torch.bfloat16, kv_dtype)
        assert got == 2 * layers * heads * (dim + 4) == 12240
        assert kv_bytes_per_token(cfg, torch.float32, kv_dtype) == got      # the model dtype does not matter
        assert got / bf16 == pytest.approx(68 / 128)                         # "half": 0.53 with the fp32 scales
    assert kv_bytes_per_token(cfg, torch.bfloat16, "auto") == bf16
    # head_dim 128 (Llama-3-8B): 132 / 256 = 0.52 of bf16.
    big = _cfg(num_kv_heads=8, head_dim=128, num_layers=32)
    assert kv_bytes_per_token(big, torch.bfloat16, "int8") / kv_bytes_per_token(big, torch.bfloat16) == 132 / 256


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_kv_cache_allocates_one_byte_values_and_fp32_scales(kv_dtype):
    cfg = _cfg(num_layers=2)
    cache = KVCache(cfg, num_blocks=4, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"),
                    kv_dtype=kv_dtype)
    assert cache.quantized and len(cache.k) == len(cache.k_scale) == 2
    assert cache.k[0].shape == (3, 64, 64) and cache.k[0].dtype == KV_STORAGE[kv_dtype]
    assert cache.v_scale[1].shape == (3, 64) and cache.v_scale[1].dtype == torch.float32
    real = sum(t.numel() * t.element_size() for t in cache.k + cache.v + cache.k_scale + cache.v_scale)
    assert real == cache.total_bytes == cache.bytes_per_token * 64
    plain = KVCache(cfg, 4, 16, torch.bfloat16, torch.device("cpu"))
    assert not plain.quantized and plain.k_scale == [None, None] and plain.k[0].dtype == torch.bfloat16


def test_default_pool_is_sized_with_the_stored_bytes():
    cfg = _cfg()
    cpu = torch.device("cpu")
    for kv_dtype in (None, "int8"):
        per_token = kv_bytes_per_token(cfg, torch.float32, kv_dtype)
        assert pool_bytes(cfg, torch.float32, cpu, 2, 1000, kv_dtype=kv_dtype) == per_token * 2 * 1000


def test_kv_dtype_values_are_validated():
    for good in (None, "auto", "int8", "fp8"):
        EngineConfig(kv_dtype=good)
    for bad in ("int4", "fp16", "bfloat16", 8, "INT8"):
        with pytest.raises(ValueError, match=r"kv_dtype=.*is not one of \(None, 'auto', 'int8', 'fp8'\)") as info:
            EngineConfig(kv_dtype=bad)
        assert repr(bad) in str(info.value)
    with pytest.raises(ValueError, match="kv_dtype='int8' needs kv_cache=True"):
        EngineConfig(kv_dtype="int8", kv_cache=False)


# ---------------------------------------------------------------- Triton kernels vs torch references

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(7, 3, 80), (13, 2, 64)])
def test_store_kv_kernel_quantizes_like_the_reference(dtype, kv_dtype, num_tokens, num_kv_heads, head_dim):
    from minillm.kernels.store_kv import store_kv, store_kv_reference

    gen = torch.Generator().manual_seed(num_tokens * 10 + head_dim)
    num_slots = 64
    # k and v as strided views of one fused tensor, with a spread of magnitudes and an all-zero head.
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen)
    fused = fused * torch.exp(torch.randn(num_tokens, 2, num_kv_heads, 1, generator=gen))
    fused[1, 0, 0] = 0.0
    fused = fused.to(dtype).to(DEVICE)
    k, v = fused[:, 0], fused[:, 1]
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens: neither values nor scales may be written
    slots = slots.to(DEVICE)
    storage = KV_STORAGE[kv_dtype]
    pool = torch.randint(-100, 100, (2, num_kv_heads, num_slots, head_dim), generator=gen).to(storage).to(DEVICE)
    scales = torch.full((2, num_kv_heads, num_slots), float("nan"), device=DEVICE)
    got = [t.clone() for t in (pool[0], pool[1], scales[0], scales[1])]
    want = [t.clone() for t in (pool[0], pool[1], scales[0], scales[1])]
    store_kv(got[0], got[1], k, v, slots, k_scale=got[2], v_scale=got[3])
    store_kv_reference(want[0], want[1], k, v, slots, k_scale=want[2], v_scale=want[3])
    kept = slots[slots >= 0]
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[kept] = False
    for name, g, w in zip(("k_cache", "v_cache"), got[:2], want[:2]):
        assert torch.equal(g[:, untouched].view(torch.uint8), pool[0 if name == "k_cache" else 1][:, untouched]
                           .view(torch.uint8)), f"{name}: a skipped slot was written"
        if DEVICE == "cpu":   # the interpreter computes the reference's arithmetic exactly: the same bits
            diff = (g.view(torch.uint8) != w.view(torch.uint8)).nonzero()
            assert diff.numel() == 0, (f"{name} differs at [head, slot, dim] {diff[0].tolist()}: got "
                                       f"{g[tuple(diff[0])].float().item()}, expected {w[tuple(diff[0])].float().item()}")
        else:                 # a GPU's fp32 division may differ by an ulp: at most one step on a tie
            step = 1.0 if kv_dtype == "int8" else 32.0
            assert (g.float() - w.float()).abs().max() <= step
    for name, g, w in zip(("k_scale", "v_scale"), got[2:], want[2:]):
        assert g[:, untouched].isnan().all(), f"{name}: a skipped slot's scale was written"
        torch.testing.assert_close(g[:, kept], w[:, kept], rtol=1e-6, atol=0)


def _assert_close(got, want, dtype, what):
    assert not got.isnan().any(), f"{what}: NaN in the output (a read of an unowned slot or of its scale)"
    err, tol = max_error(got, want)
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


# (head_dim, num_kv_heads, query group size, block_size, seq_lens, partition_size)
DECODE_CASES = [
    pytest.param(80, 2, 3, 16, [5, 1, 100, 130], 64, id="d80-gqa3-bs16"),
    pytest.param(64, 1, 8, 32, [70, 1, 33], 64, id="d64-gqa8-bs32"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim,num_kv_heads,group,block_size,seq_lens,partition_size", DECODE_CASES)
def test_paged_decode_reads_quantized_pools(dtype, kv_dtype, head_dim, num_kv_heads, group, block_size, seq_lens,
                                            partition_size):
    from minillm.kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

    gen = torch.Generator().manual_seed(head_dim + group)
    block_tables, k_cache, v_cache = scattered_pool(seq_lens, num_kv_heads, head_dim, block_size, gen)
    k_q, k_scale, v_q, v_scale = quantized_pools(k_cache, v_cache, kv_dtype, gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q, k_q, v_q, k_scale, v_scale, block_tables, lens = (t.to(DEVICE) for t in
                                                          (q, k_q, v_q, k_scale, v_scale, block_tables, lens))
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k_q, v_q, block_tables, lens, scale, block_size, partition_size,
                                 k_scale=k_scale, v_scale=v_scale)
    want = paged_decode_attention_reference(q, k_q, v_q, block_tables, lens, scale, block_size,
                                            k_scale=k_scale, v_scale=v_scale)
    _assert_close(got, want, dtype, f"paged decode {kv_dtype}")


EXTEND_CASES = [
    pytest.param(80, 2, 3, 16, [(0, 37), (20, 13), (45, 1), (0, 1)], id="d80-gqa3-bs16-mixed"),
    pytest.param(64, 1, 8, 32, [(33, 20), (0, 70)], id="d64-gqa8-bs32"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim,num_kv_heads,group,block_size,rows", EXTEND_CASES)
def test_extend_attention_reads_quantized_pools(dtype, kv_dtype, head_dim, num_kv_heads, group, block_size, rows):
    from minillm.kernels.extend_attention import extend_attention, extend_attention_reference

    gen = torch.Generator().manual_seed(head_dim * 3 + group)
    seq_lens = [cached + new for cached, new in rows]
    block_tables, k_cache, v_cache = scattered_pool(seq_lens, num_kv_heads, head_dim, block_size, gen)
    k_q, k_scale, v_q, v_scale = quantized_pools(k_cache, v_cache, kv_dtype, gen)
    num_new = torch.tensor([new for _, new in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = num_new.cumsum(0)
    q = torch.randn(int(num_new.sum()), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q, k_q, v_q, k_scale, v_scale, block_tables, qsl, lens = (
        t.to(DEVICE) for t in (q, k_q, v_q, k_scale, v_scale, block_tables, qsl, lens))
    scale = head_dim ** -0.5
    got = extend_attention(q, k_q, v_q, block_tables, qsl, lens, scale, block_size, k_scale=k_scale, v_scale=v_scale)
    want = extend_attention_reference(q, k_q, v_q, block_tables, qsl, lens, scale, block_size,
                                      k_scale=k_scale, v_scale=v_scale)
    _assert_close(got, want, dtype, f"extend {kv_dtype}")


def test_kernels_refuse_a_quantized_pool_without_scales():
    from minillm.kernels.paged_decode import paged_decode_attention
    from minillm.kernels.store_kv import store_kv

    pool = torch.zeros(2, 32, 64, dtype=torch.int8)
    k = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="needs k_scale"):
        store_kv(pool, pool.clone(), k, k, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"k_scale must be \[2, 32\]"):
        store_kv(pool, pool.clone(), k, k, torch.zeros(3, dtype=torch.int64), k_scale=torch.zeros(2, 16),
                 v_scale=torch.zeros(2, 32))
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_decode_attention(torch.zeros(1, 2, 64), pool, pool.clone(), torch.zeros(1, 2, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 0.125, 16)


# ---------------------------------------------------------------- the engine on a tiny model

NUM_PROMPTS = 32
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(n)] for n in
           [1, 2, 60, 5, 33, 17, 44, 8, 51, 3, 40, 12, 1, 35, 26, 9, 58, 4, 27, 15, 2, 42, 30, 7, 19, 55, 11, 36, 6, 50,
            24, 13]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
# The Triton backend runs in the interpreter here (minutes for 32 prompts): it gets the first 12.
NUM_TRITON_PROMPTS = 12
NUM_BACKEND_PROMPTS = 6   # torch vs triton, both quantized
# Measured (this model, these prompts, 8 greedy tokens, agreement with the unquantized cache):
# int8 31/32 (torch), 11/12 (triton; 31/32 on all 32); fp8 18/32 (torch), 8/12 (triton). fp8 e4m3 keeps
# 3 mantissa bits (~2-3% error per value against int8's ~1% at these absmax/rms ratios), and a
# random-weight model's near-tied logits flip on it. The thresholds leave a margin below the measurements.
MIN_SAME = {("int8", "torch"): 29, ("int8", "triton"): 10, ("fp8", "torch"): 16, ("fp8", "triton"): 7}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    """Two layers, GQA 6:2 (group 3), head_dim 80, random weights."""
    import shutil

    import transformers

    cfg = transformers.LlamaConfig(**{**BASE, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2,
                                      "head_dim": 80})
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp("kvq") / "llama_gqa3_hd80"
    model.save_pretrained(path)
    for f in tokenizer_files(default_model_dir):
        shutil.copy(f, path)
    return str(path)


def _generate(llm, num_prompts=NUM_PROMPTS):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:num_prompts]]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def unquantized_tokens(tiny_model):
    return _generate(LLM(tiny_model, max_num_seqs=8, max_model_len=128))


# fp8 through the Triton kernels in the interpreter (~30 s) runs with -m slow; int8 covers that path in CI.
@pytest.mark.parametrize("kv_dtype, backend", [
    pytest.param(d, b, marks=pytest.mark.slow) if (d, b) == ("fp8", "triton") else (d, b)
    for d in KV_DTYPES for b in ("torch", "triton")])
def test_engine_greedy_outputs_agree_with_the_unquantized_cache(tiny_model, unquantized_tokens, kv_dtype, backend):
    levers = dict(max_num_seqs=8, max_model_len=128, kv_dtype=kv_dtype, attention_backend=backend)
    llm = LLM(tiny_model, **levers)
    num = NUM_PROMPTS if backend == "torch" else NUM_TRITON_PROMPTS
    got = _generate(llm, num)
    same = sum(a == b for a, b in zip(got, unquantized_tokens))
    print(f"kv_dtype={kv_dtype} {backend}: {same} of {num} greedy generations equal the unquantized cache's")
    assert same >= MIN_SAME[kv_dtype, backend], f"{kv_dtype} / {backend}: {same} of {num} agree"
    assert [len(t) for t in got] == [GREEDY.max_tokens] * num
    assert llm.engine.kv_cache.k[0].dtype == KV_STORAGE[kv_dtype]
    assert_engine_idle(llm)


def test_torch_and_triton_backends_store_and_read_the_same_quantized_cache(tiny_model):
    """Both backends quantize with the same arithmetic and attend over the same cache."""
    outs = {b: _generate(LLM(tiny_model, max_num_seqs=8, max_model_len=128, kv_dtype="fp8", attention_backend=b),
                         NUM_BACKEND_PROMPTS) for b in ("torch", "triton")}
    same = sum(a == b for a, b in zip(outs["torch"], outs["triton"]))
    assert same >= NUM_BACKEND_PROMPTS - 1, f"{same} of {NUM_BACKEND_PROMPTS}"


def test_chunked_prefill_reads_the_quantized_cache_like_whole_prefill(tiny_model):
    whole = _generate(LLM(tiny_model, max_num_seqs=8, max_model_len=128, kv_dtype="int8"))
    chunked = _generate(LLM(tiny_model, max_num_seqs=8, max_model_len=128, kv_dtype="int8", chunked_prefill=True,
                            max_num_batched_tokens=32))
    assert whole == chunked   # prefill attends over the cache too, so chunking changes nothing


def test_engine_bytes_per_token_and_pool_capacity(tiny_model):
    budget = 200_000
    llms = {kd: LLM(tiny_model, kv_cache_bytes=budget, max_model_len=128, block_size=16, kv_dtype=kd)
            for kd in (None, "int8", "fp8")}
    cfg = llms[None].model_config
    layers, heads, dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert (layers, heads, dim) == (2, 2, 80)
    bf16 = 2 * layers * heads * dim * 2                      # 1280
    fp32 = llms[None].kv_bytes_per_token
    assert fp32 == 2 * bf16                                  # the CPU model runs in fp32
    for kd in KV_DTYPES:
        per_token = llms[kd].kv_bytes_per_token
        assert per_token == 2 * layers * heads * (dim + 4) == 672
        assert per_token / bf16 == pytest.approx(84 / 160)   # 0.525: halves, less the scales
        tokens = llms[kd].engine.block_manager.capacity_tokens
        assert tokens == budget // (per_token * 16) * 16 == 288
        assert llms[kd].engine.kv_cache.total_bytes <= budget
    assert llms[None].engine.block_manager.capacity_tokens == budget // (fp32 * 16) * 16 == 64
    # A bf16 model's pool of the same bytes holds 1.9x fewer tokens than the int8 one.
    assert budget // (bf16 * 16) * 16 == 144


# ---------------------------------------------------------------- the default model

CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Explain what a CPU cache is in one sentence.", "List three fruits.",
                "How do I boil an egg?", "What is 12 times 7?"]


@pytest.fixture(scope="module")
def default_int8(default_llm):
    return default_llm.with_levers(kv_dtype="int8")   # shares the weights, own (int8) KV pool


@pytest.mark.slow   # two engines x 6 chats x 16 tokens on the 135M model: minutes on a 2-core CPU
def test_default_model_int8_kv_greedy_agrees_with_the_unquantized_cache(default_llm, default_int8):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    want = [o.outputs[0].token_ids for o in default_llm.chat(chats, params)]
    got = [o.outputs[0].token_ids for o in default_int8.chat(chats, params)]
    # Tokens each generation shares with the unquantized one before the first difference.
    prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    same = sum(p == len(w) for p, w in zip(prefix, want))
    print(f"default model, int8 KV: {same} of {len(CHAT_PROMPTS)} 16-token greedy generations identical; "
          f"tokens before the first difference: {prefix}")
    # Measured: 3 of 6 identical, first differences at tokens 6-15 in the others (int8 K/V carry ~1%
    # error per head vector; a 135M model's greedy path flips at a near-tie and then diverges).
    assert same >= 3, prefix
    assert sum(p >= 1 for p in prefix) >= len(CHAT_PROMPTS) - 1, prefix   # the first token
    assert sum(prefix) / len(prefix) >= 8, prefix
    assert default_int8.kv_bytes_per_token == 12240 and default_llm.kv_bytes_per_token == 46080
    assert_engine_idle(default_int8)
    assert_engine_idle(default_llm)


def test_padded_cuda_graph_decode_path_with_int8_kv():
    """The CUDA-graph static-buffer path (run eagerly here, capture=False) with an int8 pool: padding
    rows (slot -1, seq_len 1) write no value and no scale, and real rows equal the plain path's."""
    plain = LLM("random:tiny-llama", attention_backend="triton", max_num_seqs=8, max_model_len=128, kv_dtype="int8")
    padded = plain.with_levers()
    padded.engine.runner.enable_cuda_graphs(8, 128, capture=False)
    for ks, vs in zip(padded.engine.kv_cache.k_scale, padded.engine.kv_cache.v_scale):
        ks.fill_(float("nan"))   # a read of an unwritten slot's scale turns that row's logits into NaN
        vs.fill_(float("nan"))
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=gen).tolist()} for n in (15, 6, 1)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 2, 4)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params)]
    assert got == want
    assert padded.engine.runner.graphs.num_steps > 0
    assert_engine_idle(padded)
