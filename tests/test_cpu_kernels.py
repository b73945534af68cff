"""minillm's CPU kernels (minillm/kernels/cpu.py) against their torch references, on fresh random inputs,
and the engine with them (attention_backend="auto" picks them for fp32 on the CPU)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minillm.kernels import cpu
from minillm.layers.attention import TorchAttentionBackend
from minillm.layers.rotary import RotaryEmbedding
from minillm.quant.linear import QuantizedLinear

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels not built: {cpu.unavailable_reason()}")

SHAPES = [(960, 576), (576, 1536), (37, 64), (5, 200)]   # real layers, an odd row count, K tails


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_mm_f32_and_mm_i8_equal_float64_references(m, threads, gen):
    for n, k in SHAPES:
        x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        ref = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(cpu.mm_f32(x, w, b, threads=threads).double(), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cpu.mm_f32(x, w, threads=threads).double(), ref - b.double(), rtol=1e-4, atol=1e-4)
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        s = torch.rand(n, generator=gen) / 100
        ref = F.linear(x.double(), q.double() * s.double()[:, None], b.double())
        torch.testing.assert_close(cpu.mm_i8(x, q, s, b, threads=threads).double(), ref, rtol=1e-4, atol=1e-4)


def test_quantize_x_matches_its_torch_reference_bit_for_bit(gen):
    x = torch.randn(3, 256, generator=gen) * 4
    x[1, 32:64] = 0                      # an all-zero block: d = 0, levels 0
    xq, d = cpu.quantize_x(x)
    rq, rd = cpu.quantize_x_reference(x)
    assert torch.equal(xq, rq) and torch.equal(d, rd)
    assert int(xq.abs().max()) == 127 and float(d[1, 1]) == 0.0
    err = (xq.float().view(3, -1, 32) * d[..., None] - x.view(3, -1, 32)).abs()
    assert bool((err <= d[..., None] / 2 + 1e-6).all())    # round to nearest: within half a step


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_mm_i4_equals_its_reference_on_the_rounded_activations(m, group_size, gen):
    for n, k in [(960, 576 + (-576) % group_size), (48, 256)]:
        levels = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        packed = cpu.pack_i4(levels)
        assert torch.equal(cpu.unpack_i4(packed), levels)
        scale, zero = torch.rand(n, k // group_size, generator=gen) / 10, torch.randn(n, k // group_size, generator=gen) / 10
        w = (levels.double().view(n, -1, group_size) * scale.double()[..., None] + zero.double()[..., None]).view(n, k)
        x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        xq, d = cpu.quantize_x_reference(x)
        x_hat = (xq.double().view(m, -1, 32) * d.double()[..., None]).view(m, k)
        got = cpu.mm_i4(x, packed, scale, zero, group_size, b)
        torch.testing.assert_close(got.double(), F.linear(x_hat, w, b.double()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("group_size", [64, 128])
def test_mm_i4_skips_the_padded_tail_of_a_row(m, group_size, gen):
    # in_features 576 (the default model's hidden size) padded to whole groups: 640 for g128, 576 + 0 for g64,
    # and 608 -> 640 / 640. x without the padding gives the bits x padded with zeros gives.
    for n, k in [(96, 576), (40, 608), (24, 160)]:
        kp = k + (-k) % group_size
        levels = torch.randint(0, 16, (n, kp), generator=gen, dtype=torch.uint8)
        packed = cpu.pack_i4(levels)
        scale = torch.rand(n, kp // group_size, generator=gen) / 10
        zero = torch.randn(n, kp // group_size, generator=gen) / 10
        x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        got = cpu.mm_i4(x, packed, scale, zero, group_size, b)
        padded = cpu.mm_i4(F.pad(x, (0, kp - k)), packed, scale, zero, group_size, b)
        assert torch.equal(got, padded)
        w = (levels.double().view(n, -1, group_size) * scale.double()[..., None] + zero.double()[..., None]).view(n, kp)
        xq, d = cpu.quantize_x_reference(x)
        x_hat = (xq.double().view(m, -1, 32) * d.double()[..., None]).view(m, k)
        torch.testing.assert_close(got.double(), F.linear(x_hat, w[:, :k], b.double()), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="in_features=672"):   # wider than the packed rows
        cpu.mm_i4(torch.randn(1, 672), packed, scale, zero, group_size)


@pytest.mark.parametrize("group_size", [32, 128])
def test_mm_i4_gives_a_row_the_same_bits_alone_and_in_a_batch(group_size, gen):
    # one activation row takes another loop (two weight rows at a time) than several; an odd N leaves a last
    # weight row alone, and an odd block count (K = 608) a last block alone
    for n, k in [(37, 576), (53, 608)]:
        kp = k + (-k) % group_size
        packed = cpu.pack_i4(torch.randint(0, 16, (n, kp), generator=gen, dtype=torch.uint8))
        scale = torch.rand(n, kp // group_size, generator=gen) / 10
        zero = torch.randn(n, kp // group_size, generator=gen) / 10
        x = torch.randn(5, k, generator=gen)
        batch = cpu.mm_i4(x, packed, scale, zero, group_size)
        for i in range(5):
            assert torch.equal(cpu.mm_i4(x[i:i + 1].contiguous(), packed, scale, zero, group_size), batch[i:i + 1])


def test_pack_i4_layout_is_the_documented_one():
    levels = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    levels[0, 16:] = 15 - levels[0, 16:]
    packed = cpu.pack_i4(levels)
    assert packed.shape == (1, 16)
    assert [int(v) & 15 for v in packed[0]] == levels[0, :16].tolist()
    assert [int(v) >> 4 for v in packed[0]] == levels[0, 16:].tolist()


def test_rmsnorm_with_and_without_the_fused_residual_add(gen):
    x, r, w = torch.randn(5, 576, generator=gen), torch.randn(5, 576, generator=gen), torch.randn(576, generator=gen)

    def ref(v):
        return w * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)

    torch.testing.assert_close(cpu.rmsnorm(x, w, 1e-5), ref(x), rtol=1e-5, atol=1e-5)
    residual = r.clone()
    torch.testing.assert_close(cpu.rmsnorm(x, w, 1e-5, residual=residual), ref(r + x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, r + x)          # written in place


def test_rotary_rotates_views_of_a_fused_qkv_row_like_the_torch_path(gen):
    rope = RotaryEmbedding(64, 512, 10000.0, None, torch.float32)
    qkv = torch.randn(6, 9 * 64 + 2 * 3 * 64, generator=gen)
    positions = torch.randint(0, 512, (6,), generator=gen)
    q, k = qkv[:, :576].view(6, 9, 64), qkv[:, 576:768].view(6, 3, 64)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    v_before = qkv[:, 768:].clone()
    cpu.rotary(positions, q, k, rope.cos, rope.sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 768:], v_before)           # v untouched
    with pytest.raises(ValueError, match="positions reach 600"):
        cpu.rotary(torch.tensor([600] * 6), q, k, rope.cos, rope.sin)


def test_silu_mul(gen):
    gu = torch.randn(3, 2 * 1536, generator=gen) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_store_kv_and_paged_decode_attention_equal_the_torch_reference(threads, gen):
    hq, hk, d, bs, blocks = 9, 3, 64, 16, 40
    k_cache, v_cache = torch.zeros(hk, blocks * bs, d), torch.zeros(hk, blocks * bs, d)
    lens = [1, 17, 70, 33]
    order = torch.randperm(blocks, generator=gen).tolist()    # blocks scattered over the pool
    tables, used = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(order[used:used + need])
        used += need
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    backend = TorchAttentionBackend()
    for n, table in zip(lens, tables):                        # fill each sequence's keys and values
        slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(n)])
        kv = torch.randn(n, 2 * hk * d, generator=gen)
        cpu.store_kv(k_cache, v_cache, kv[:, :hk * d].view(n, hk, d), kv[:, hk * d:].view(n, hk, d), slots)
        assert torch.equal(k_cache[:, slots], kv[:, :hk * d].view(n, hk, d).transpose(0, 1))
    q = torch.randn(len(lens), hq, d, generator=gen)
    got = cpu.decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), bs, 0.125,
                               threads=threads)
    for i, (n, table) in enumerate(zip(lens, tables)):
        slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(n)])
        want = backend.attend(q[i:i + 1], k_cache[:, slots], v_cache[:, slots], 0.125, n - 1)
        torch.testing.assert_close(got[i], want[0], rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_with_the_value_not_a_crash():
    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match="torch.float32"):
        cpu.mm_f32(torch.randn(1, 32, dtype=torch.float64), w)
    with pytest.raises(ValueError, match=r"weight has shape \(8, 32\), expected \(8, 16\)"):
        cpu.mm_f32(torch.randn(1, 16), w)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.mm_f32(torch.randn(32, 2).t(), w)
    with pytest.raises(ValueError, match="group_size=48"):
        cpu.mm_i4(torch.randn(1, 96), torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 2), torch.ones(8, 2), 48)
    k_cache = torch.zeros(1, 32, 8)
    kv = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping reaches 32, the pool has 32 slots"):
        cpu.store_kv(k_cache, k_cache.clone(), kv, kv, torch.tensor([32]))
    with pytest.raises(ValueError, match="seq_lens must be in"):
        cpu.decode_attention(torch.zeros(1, 1, 8), k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([17], dtype=torch.int32), 16, 1.0)


@pytest.mark.parametrize("weight_dtype,group_size", [("int8", None), ("int4", 32), ("int4", 128)])
def test_quantized_layers_take_the_cpu_path_and_multiply_by_their_dequantized_weight(weight_dtype, group_size, gen):
    w, b = torch.randn(96, 200, generator=gen), torch.randn(96, generator=gen)
    layer = QuantizedLinear.from_float(w, b, weight_dtype, group_size=group_size or 128)
    assert layer.path == "cpu"
    wd = layer.dequantized_weight(torch.float32)
    for m in (1, 3, 20, 70):                               # 70 rows: a long prefill, through F.linear
        x = torch.randn(m, 200, generator=gen)
        if weight_dtype == "int4" and m <= cpu.QUANT_KERNEL_ROWS:
            xp = F.pad(x, (0, layer.pad))
            xq, d = cpu.quantize_x_reference(xp)
            x_ref = (xq.float().view(m, -1, 32) * d[..., None]).view(m, -1)[:, :200]
        else:
            x_ref = x
        torch.testing.assert_close(layer(x), F.linear(x_ref, wd, b), rtol=1e-4, atol=1e-4)
    ids = torch.tensor([0, 95, 7])
    assert torch.equal(layer.rows(ids), wd[ids])
    if weight_dtype == "int4":
        packed, scale, zero = layer.int4_parts()               # the plain layout, from the CPU layout
        from minillm.quant.int4 import dequantize_int4, unpack_int4
        assert torch.equal(dequantize_int4(unpack_int4(packed), scale, zero)[:, :200], wd)


def test_the_default_engine_uses_the_cpu_kernels_and_keeps_the_reference_tokens(default_llm):
    from minillm.sampling import SamplingParams

    llm = default_llm
    assert llm.config.attention_backend == "auto"
    reference = llm.with_levers(attention_backend="torch")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.backend.name == "cpu" and llm.engine.runner.ops == "cpu"
    theirs = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    assert reference.engine.runner.backend.name == "torch" and reference.engine.runner.ops == "torch"
    assert ours == theirs


def test_without_the_kernels_the_engine_falls_back_to_torch(tmp_path):
    code = ("from minillm.kernels import cpu; from minillm.llm import LLM; "
            "llm = LLM('random:tiny-llama'); print(cpu.available(), cpu.unavailable_reason(), "
            "llm.engine.runner.backend.name, len(llm.generate([{'prompt_token_ids': [1, 2, 3]}])[0].outputs[0].token_ids) > 0)")
    env = {**os.environ, "MINILLM_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "turned", "off", "by", "MINILLM_CPU_KERNELS=0", "torch", "True"]


def _decode_layers_calls(monkeypatch) -> list[int]:
    """Counts cpu.decode_layers calls (the fused decode step) while the test runs."""
    calls = []
    real = cpu.decode_layers

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, "decode_layers", counting)
    return calls


def _greedy_with_logprobs(llm, prompts):
    from minillm.sampling import SamplingParams

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("levers", [{}, {"weight_dtype": "int8"}, {"weight_dtype": "int4", "weight_group_size": 128},
                                    {"weight_dtype": "int4", "weight_group_size": 32}],
                         ids=["fp32", "int8", "int4-g128", "int4-g32"])
def test_the_fused_decode_step_gives_the_layer_by_layer_bits(default_llm, levers, monkeypatch):
    """models/cpu_decode.py runs a decode step's layers in one C call: the same kernels in the same order, so
    the same logprobs to the bit as DecoderLayer.forward_fused, for one sequence and for three of
    different lengths (int4 g128 pads the 576 input channels to 640)."""
    llm = default_llm.with_levers(**levers) if levers else default_llm
    runner = llm.engine.runner
    calls = _decode_layers_calls(monkeypatch)
    prompts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "Once upon a time"]
    for batch in (prompts[:1], prompts):
        calls.clear()
        fused = _greedy_with_logprobs(llm, batch)
        assert len(calls) >= 9, "the decode steps did not take the fused path"
        runner.fuse_cpu_decode = False
        try:
            calls.clear()
            layered = _greedy_with_logprobs(llm, batch)
            assert not calls
        finally:
            runner.fuse_cpu_decode = True
        assert fused == layered


def test_the_fused_decode_step_steps_aside_for_what_it_does_not_cover(default_llm, monkeypatch):
    """A forward hook on a projection and a quantized KV pool send the step back to the layers (the hook still
    runs on every step); so does a plugged quantized matmul, in its own engine only: another engine on the
    same weights keeps the fused path."""
    calls = _decode_layers_calls(monkeypatch)
    llm = default_llm
    seen = []
    handle = llm.engine.model.layers[3].qkv_proj.register_forward_hook(lambda module, args, out: seen.append(1))
    try:
        _greedy_with_logprobs(llm, ["Hello there, my friend"])
    finally:
        handle.remove()
    assert not calls and len(seen) == 10     # the prompt and 9 decode steps, all layer by layer
    _greedy_with_logprobs(llm, ["Hello there, my friend"])
    assert len(calls) == 9                   # the hook is gone: the plan is built again and used
    calls.clear()
    int8_kv = llm.with_levers(kv_dtype="int8")
    _greedy_with_logprobs(int8_kv, ["Hello there, my friend"])
    assert not calls
    # a plugged matmul (a lab's kernel): the decode steps of its engine call it, not the plan
    int8 = llm.with_levers(weight_dtype="int8")
    _greedy_with_logprobs(int8, ["Hello there, my friend"])
    assert len(calls) == 9
    calls.clear()
    rows = []

    def plugged(x2d, layer):
        rows.append(x2d.shape[0])
        return x2d @ layer.dequantized_weight(x2d.dtype).t()

    mine = int8.with_levers(quantized_matmul=plugged)
    assert mine.engine.model is int8.engine.model      # the same weights
    _greedy_with_logprobs(mine, ["Hello there, my friend"])
    assert not calls and rows.count(1) >= 9 * 4 * 30
    rows.clear()
    _greedy_with_logprobs(int8, ["Hello there, my friend"])
    assert len(calls) == 9 and not rows                # the other engine: fused, never the plugged matmul
