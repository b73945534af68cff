"""Weight quantization (minillm/quant, the weight_dtype lever): error bounds of the quantizers on
fresh random matrices, int4 packing, weight bytes, the CPU fast paths against the dequantize
reference, and the engine on the default model."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.kernels import cpu
from minillm.layers.linear import Linear
from minillm.quant import (QuantizedLinear, dequantize_fp8, dequantize_int4, dequantize_int8, pack_int4,
                           quantize_fp8, quantize_int4, quantize_int8, unpack_int4)

SHAPES = [(1, 2), (37, 53), (96, 200), (3, 576)]


def fresh(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, 0] = 0.7  # an outlier, as real checkpoints have
    return w


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_error_is_at_most_half_a_step_per_channel(shape):
    w = fresh(shape, 1)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (shape[0],)
    assert q.abs().max() <= 127
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all()


def test_int8_zero_row_stays_zero():
    w = torch.zeros(3, 8)
    w[1] = 1.0
    q, scale = quantize_int8(w)
    assert torch.equal(dequantize_int8(q, scale), w)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 48])
def test_int4_error_is_at_most_half_a_step_per_group(group, rows):
    k = group * 3
    w = fresh((rows, k), group + rows)
    q, scale, zero = quantize_int4(w, group)
    assert q.dtype == torch.uint8 and q.max() <= 15 and scale.shape == zero.shape == (rows, k // group)
    g = w.reshape(rows, k // group, group)
    bound = (g.amax(2) - g.amin(2)) / 15 / 2
    err = (dequantize_int4(q, scale, zero) - w).abs().reshape(rows, k // group, group)
    assert (err <= bound[..., None] * (1 + 1e-5) + 1e-7).all()


def test_int4_odd_in_features_are_refused_by_the_quantizer_and_padded_by_the_layer():
    w = fresh((16, 200), 3)
    with pytest.raises(ValueError, match=r"in_features=200 is not a multiple of group_size=128"):
        quantize_int4(w, 128)
    for fast in (True, False):
        layer = QuantizedLinear.from_float(w, None, "int4", 128, fast=fast)
        assert layer.pad == 56 and layer.dequantized_weight().shape == (16, 200)
        x = torch.randn(3, 200)
        torch.testing.assert_close(layer(x), F.linear(x, layer.dequantized_weight()), rtol=2e-2, atol=2e-2)
        # Padding changes nothing the first 128 columns see: their group quantizes as alone.
        q, scale, zero = quantize_int4(w[:, :128], 128)
        torch.testing.assert_close(layer.dequantized_weight()[:, :128], dequantize_int4(q, scale, zero),
                                   rtol=0, atol=float(scale.max()) / 10)  # bf16 scales, zeros and output


def test_int4_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (7, 34), dtype=torch.uint8, generator=g)
    packed = pack_int4(q)
    assert packed.shape == (7, 17) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(packed[0, 0], q[0, 0] | (q[0, 1] << 4))
    with pytest.raises(ValueError, match="even number of columns"):
        pack_int4(q[:, :3])


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_error_is_relative(shape):
    w = fresh(shape, 5)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    err = (dequantize_fp8(q, scale) - w).abs()
    # e4m3: 3 mantissa bits -> half an ulp is 1/16 of the value; subnormals step by 2^-9 (x scale).
    assert (err <= w.abs() / 16 + scale[:, None] * 2.0 ** -10 + 1e-12).all()


@pytest.fixture(params=["cpu-kernels", "torch-kernels"])
def kernels(request, monkeypatch):
    """Each fast-path test twice: with minillm's CPU kernels (path "cpu") and without them (torch's packed
    kernels, the path on machines with no C compiler)."""
    if request.param == "torch-kernels":
        monkeypatch.setattr(cpu, "available", lambda: False)
    elif not cpu.available():
        pytest.skip(f"CPU kernels not built: {cpu.unavailable_reason()}")
    return request.param


@pytest.mark.parametrize("k", [208, 200])
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_fast_path_matches_the_dequantize_reference(kind, k, kernels):
    w = fresh((96, k), 6).t().contiguous().t()  # column-major: a layout QuantizedLinear must also accept
    fast = QuantizedLinear.from_float(w, None, kind, 64, fast=True)
    ref = QuantizedLinear.from_float(w, None, kind, 64, fast=False)
    assert ref.path == "dequant"
    if kernels == "cpu-kernels" and kind in ("int8", "int4"):
        assert fast.path == "cpu"
    elif kind == "int4" or (kind == "int8" and k % 16 == 0):  # int4 pads K to the group size
        assert fast.path == f"{kind}pack", "torch's packed CPU kernel should be available in this torch"
    elif kind == "int8":  # torch's int8 kernel needs K % 16 == 0 (AVX-512 crashed on K = 200)
        assert fast.path == "dequant"
    x = torch.randn(5, k)
    expected = F.linear(x, ref.dequantized_weight())
    step = {"int8": 1 / 127, "int4": 1 / 15, "fp8": 1 / 16}[kind]
    # Same levels; torch's fast paths round activations and scales to bf16, the int4 CPU kernel activations to int8.
    torch.testing.assert_close(fast(x), expected, rtol=2e-2, atol=0.02 * float(expected.abs().max()))
    x_ref = x
    if fast.path == "cpu" and kind == "int4":   # that kernel multiplies x rounded to int8 per block of 32
        xq, d = cpu.quantize_x_reference(F.pad(x, (0, fast.pad)))
        x_ref = (xq.float().view(5, -1, 32) * d[..., None]).view(5, -1)[:, :k]
    torch.testing.assert_close(fast(x), F.linear(x_ref, fast.dequantized_weight()), rtol=1e-2, atol=1e-2)
    # And the quantized layer is close to the float one, within the quantization step.
    assert (fast(x) - x @ w.t()).abs().max() < step * float(w.abs().max()) * k ** 0.5 * 2
    # 3-d inputs keep their leading shape.
    assert fast(x.reshape(1, 5, k)).shape == (1, 5, 96)


def test_weight_bytes_int8_half_int4_under_30_percent_of_bf16():
    w = fresh((960, 576), 7)  # SmolLM2's qkv shape: 576 is not a multiple of 128 (padded to 640)
    bf16 = w.numel() * 2
    assert QuantizedLinear.from_float(w, None, "int8").quantized_bytes() / bf16 == pytest.approx(0.5, abs=0.01)
    for group in (64, 128):
        assert QuantizedLinear.from_float(w, None, "int4", group).quantized_bytes() / bf16 <= 0.30
    # group 32: 0.5 + 2 x 2 bytes / 32 per weight = 0.625 bytes, 31% of bf16.
    assert QuantizedLinear.from_float(w, None, "int4", 32).quantized_bytes() / bf16 == pytest.approx(0.3125)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("kwargs, pattern", [
    ({"weight_dtype": "int3"}, r"weight_dtype='int3' is not one of \(None, 'int8', 'int4', 'fp8'\)"),
    ({"weight_dtype": "int4", "weight_group_size": 100}, r"weight_group_size=100 is not one of \(32, 64, 128\)"),
    ({"weight_dtype": "int4", "weight_calibration": "smoothquant"},
     r"weight_calibration='smoothquant' is not one of \(None, 'awq', 'gptq', 'gptq-tuned', 'autoround'\)"),
    ({"weight_calibration": "awq"}, r"weight_calibration='awq' needs a weight_dtype"),
])
def test_bad_weight_options_are_refused_before_loading(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        LLM(**kwargs)


# ------------------------------------------------------------------ the engine on the default model
PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
           "The three primary colours are", "Water boils at a temperature of", "My favourite food is",
           "The largest planet in the solar system is", "To make a cup of tea, first"]


@pytest.fixture(scope="module")
def int8_llm(default_llm):
    return default_llm.with_levers(weight_dtype="int8")


def test_int8_engine_agrees_with_the_float_model_and_leaves_it_untouched(default_llm, int8_llm, idle_check):
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ref = [o.outputs[0].token_ids[0] for o in default_llm.generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids[0] for o in int8_llm.generate(PROMPTS, params)]
    agree = sum(a == b for a, b in zip(ref, got))
    assert agree >= 6, f"int8 top-1 agrees with fp32 on {agree}/{len(PROMPTS)} prompts"
    # The donor keeps its float layers; the quantized engine looks its tied embedding up in the int8 head.
    model, qmodel = default_llm.engine.model, int8_llm.engine.model
    assert qmodel is not model and isinstance(model.layers[0].qkv_proj, Linear) and model.quantized_head is None
    assert isinstance(qmodel.layers[0].qkv_proj, QuantizedLinear) and qmodel.quantized_head is not None
    assert qmodel.embed_tokens is None and model.embed_tokens is not None
    ids = torch.tensor([0, 42, 49151])
    assert torch.equal(qmodel.embed(ids), qmodel.quantized_head.dequantized_weight()[ids])
    assert int8_llm.weight_bytes < 0.5 * default_llm.weight_bytes
    again = [o.outputs[0].token_ids[0] for o in default_llm.generate(PROMPTS, params)]
    assert again == ref
    idle_check(default_llm)
    idle_check(int8_llm)


def test_int8_engine_generates_end_to_end_and_shares_with_its_own_levers(int8_llm, idle_check):
    out = int8_llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 8 and out[0].outputs[0].text.strip()
    other = int8_llm.with_levers(max_num_seqs=2)  # same weight format: the quantized model is shared
    assert other.engine.model is int8_llm.engine.model
    idle_check(int8_llm)


def test_int4_engine_runs(default_llm, idle_check):
    int4 = default_llm.with_levers(weight_dtype="int4", weight_group_size=64)
    layer = int4.engine.model.layers[0].gate_up_proj
    assert layer.weight_dtype == "int4" and layer.group_size == 64
    out = int4.generate(["The capital of France is"], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 2
    idle_check(int4)


# ------------------------------------------------------------------ activation-aware hook (AWQ)
def test_awq_scale_search_beats_round_to_nearest_on_salient_channels():
    from minillm.quant.awq import fake_quantize, search_input_scale

    g = torch.Generator().manual_seed(8)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(96, 256, generator=g)
    x[:, :4] *= 30  # four salient input channels, as in LLM activations
    s, alpha, errors = search_input_scale(w, x, "int4", 128)
    assert alpha > 0 and errors[0] == pytest.approx(float((x @ fake_quantize(w, "int4", 128).t() - x @ w.t()).pow(2).mean()))
    assert min(errors) < 0.8 * errors[0], f"AWQ should cut the output error of RTN: {errors}"
    # The hook: QuantizedLinear.from_float(input_scale=s) computes (x / s) Q(W s)^T on every path.
    for fast in (True, False):
        layer = QuantizedLinear.from_float(w, None, "int4", 128, fast=fast, input_scale=s)
        rtn = QuantizedLinear.from_float(w, None, "int4", 128, fast=fast)
        err_awq = (layer(x) - x @ w.t()).pow(2).mean()
        err_rtn = (rtn(x) - x @ w.t()).pow(2).mean()
        assert err_awq < 0.8 * err_rtn


def test_awq_module_objective_scores_the_block_each_matrix_feeds():
    """objective="module": QKV's scale is scored on attention + o_proj, gate/up's on the MLP (llm-awq);
    on that block output it never does worse than the per-matrix objective (same alpha grid), and
    the module functions reproduce the layer's own float computation."""
    from minillm.layers.attention import AttentionMetadata
    from minillm.models.quantize import awq_module, calibrate_awq
    from minillm.quant.awq import fake_quantize

    llm = LLM("random:tiny-llama", max_num_seqs=2)
    model = llm.engine.model
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # a few large input channels, as in LLM activations
        model.embed_tokens.weight[:, :3] *= 8
    calib = torch.randint(0, model.cfg.vocab_size, (96,), generator=g).tolist()
    with pytest.raises(ValueError, match=r"objective='block' must be 'module' or 'linear'"):
        calibrate_awq(model, calib, "int4", 32, objective="block", progress=False)
    results = {obj: calibrate_awq(model, calib, "int4", 32, objective=obj, progress=False)[0]
               for obj in ("module", "linear")}
    n = len(calib)
    positions = torch.arange(n)
    meta = AttentionMetadata(query_lens=[n], num_cached=[0], slot_mapping=None, use_cache=False)
    layer = model.layers[1]
    with torch.inference_mode():   # a pass without a pool: torch attention
        hidden = model.embed_tokens(torch.tensor(calib))
        hidden = model.layers[0](positions, hidden, meta)
        x_attn = layer.input_layernorm(hidden)
        attn_ref = layer.attention(positions, x_attn, meta)
        x_mlp = layer.post_attention_layernorm(hidden + attn_ref)
        for name, x, ref in (("qkv_proj", x_attn, attn_ref), ("gate_up_proj", x_mlp, layer.mlp(x_mlp))):
            module = awq_module(layer, name, positions, meta)
            w = getattr(layer, name).weight.float()
            torch.testing.assert_close(module(x.float(), w), ref.float(), rtol=1e-4, atol=1e-5)
            errors = {}
            for obj, scales in results.items():
                s = scales[f"layers.1.{name}"]
                errors[obj] = float((module(x.float() / s, fake_quantize(w * s, "int4", 32)) - ref.float()).pow(2).mean())
            assert errors["module"] <= errors["linear"] * (1 + 1e-5), (name, errors)
        assert awq_module(layer, "o_proj", positions, meta) is None and awq_module(layer, "down_proj", positions, meta) is None


def test_awq_lever_on_a_random_model_quantizes_with_input_scales():
    llm = LLM("random:tiny-llama", weight_dtype="int4", weight_group_size=32, weight_calibration="awq")
    layer = llm.engine.model.layers[1].gate_up_proj
    assert isinstance(layer, QuantizedLinear) and layer.inv_input_scale is not None
    assert llm.engine.model.quantized_head.inv_input_scale is None  # the head stays round-to-nearest
    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    plain = llm.with_levers(weight_calibration=None)  # a quantized donor: reloaded, not shared
    assert plain.engine.model is not llm.engine.model
    assert plain.engine.model.layers[1].gate_up_proj.inv_input_scale is None


# ------------------------------------------------------------------ plain layouts and the plug-in hook
@pytest.mark.parametrize("n, k, group", [(48, 200, 64), (80, 96, 32), (37, 131, 128)])
def test_int4_parts_are_the_plain_layout_on_every_path(n, k, group, kernels):
    w = fresh((n, k), n + k)
    w[1] += 2.0  # a row far from zero: its groups' zeros are large next to their scales
    q, _, _ = quantize_int4(F.pad(w, (0, (-k) % group)), group)
    layers = [QuantizedLinear.from_float(w, None, "int4", group, fast=f) for f in (True, False)]
    if kernels == "cpu-kernels":
        assert layers[0].path == "cpu"     # its own layout, unpacked back
    elif n % 16 == 0:
        assert layers[0].path == "int4pack"  # the recovered case
    for layer in layers:
        packed, scale, zero = layer.int4_parts()
        kp = k + layer.pad
        assert packed.dtype == torch.uint8 and packed.shape == (n, kp // 2)
        assert scale.dtype == zero.dtype == torch.float32 and scale.shape == zero.shape == (n, kp // group)
        assert torch.equal(unpack_int4(packed), q), layer.path  # the same 4-bit levels as the quantizer's
        w_plain = dequantize_int4(unpack_int4(packed), scale, zero)[:, :k]
        assert torch.equal(w_plain, layer.dequantized_weight()), layer.path
        assert layer.int4_parts()[0] is packed or layer.path != "int4pack"  # recovered once, then cached
        # And the layer really multiplies by that matrix (fast paths round activations to bf16).
        x = torch.randn(3, k)
        torch.testing.assert_close(layer(x), F.linear(x, w_plain), rtol=2e-2, atol=0.02 * float(F.linear(x, w_plain).abs().max()))
    with pytest.raises(ValueError, match=r"int8_parts\(\) needs weight_dtype='int8', this layer has 'int4'"):
        layers[0].int8_parts()


def test_int8_parts_are_q_and_a_float_scale_on_every_path():
    w = fresh((96, 200), 11)
    q_ref, scale_ref = quantize_int8(w)
    for fast in (True, False):
        layer = QuantizedLinear.from_float(w, None, "int8", fast=fast)
        q, scale = layer.int8_parts()
        assert torch.equal(q, q_ref) and scale.dtype == torch.float32 and scale.shape == (96,)
        torch.testing.assert_close(scale, scale_ref, rtol=2 ** -8, atol=0)  # bf16 on the int8pack path
        assert torch.equal(dequantize_int8(q, scale), layer.dequantized_weight())
    with pytest.raises(ValueError, match=r"int4_parts\(\) needs weight_dtype='int4', this layer has 'int8'"):
        layer.int4_parts()


def test_a_plugged_matmul_replaces_the_path_after_input_scale_and_before_bias():
    g = torch.Generator().manual_seed(12)
    w, bias, s = fresh((16, 64), 12), torch.randn(16, generator=g), torch.rand(64, generator=g) + 0.5
    layer = QuantizedLinear.from_float(w, bias, "int4", 32, input_scale=s)
    x = torch.randn(2, 3, 64, generator=g)
    seen = []

    def fn(x2d, lay):
        seen.append((x2d.shape, x2d.dtype))
        return torch.full((x2d.shape[0], lay.out_features), 7.0) + x2d[:, :1]

    y = layer(x, fn)
    assert seen == [((6, 64), torch.float32)]
    x2d = (x * layer.inv_input_scale).reshape(6, 64)
    torch.testing.assert_close(y, (7.0 + x2d[:, :1] + bias).reshape(2, 3, 16))
    want = F.linear(x * layer.inv_input_scale, layer.dequantized_weight(), bias)
    torch.testing.assert_close(layer(x), want, rtol=2e-2, atol=2e-2)      # the layer keeps no plug-in
    torch.testing.assert_close(layer.own_matmul(x2d) + bias, want.reshape(6, 16), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"returned \(6, 3\) for a int4 layer \[16, 64\]"):
        layer(x, lambda x2d, lay: x2d[:, :3])


def int4_torch_matmul(x2d, layer):
    """A plug-in computing with the plain layout the way the CPU int4 kernel rounds: bf16
    activations, fp32 weights and sums, bf16 result."""
    packed, scale, zero = layer.int4_parts()
    w = dequantize_int4(unpack_int4(packed), scale, zero)[:, : layer.in_features]
    return (x2d.to(torch.bfloat16).float() @ w.t()).to(torch.bfloat16).to(x2d.dtype)


def test_a_torch_int4_hook_gives_the_engine_s_greedy_tokens():
    llm = LLM("random:tiny-llama", weight_dtype="int4", weight_group_size=32)
    prompts = [{"prompt_token_ids": [1, 5, 9, 13]}, {"prompt_token_ids": [7, 300, 42, 99, 11, 3]}]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    calls = []

    def hook(x2d, layer):
        calls.append(layer)
        return int4_torch_matmul(x2d, layer)

    int4_layers = {m for m in llm.engine.model.modules() if isinstance(m, QuantizedLinear) and m.weight_dtype == "int4"}
    assert len(int4_layers) >= 8  # 2 layers x 4 Linears (+ the head when it is int4 too)
    got = [o.outputs[0].token_ids for o in llm.with_levers(quantized_matmul=hook).generate(prompts, params)]
    assert {id(m) for m in calls} == {id(m) for m in int4_layers} and got == ref
    wrong = llm.with_levers(quantized_matmul=lambda x2d, layer: torch.zeros(x2d.shape[0], layer.out_features))
    assert [o.outputs[0].token_ids for o in wrong.generate(prompts, params)] != ref   # a wrong kernel shows
    n = len(calls)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref and len(calls) == n
    with pytest.raises(ValueError, match=r"quantized_matmul= needs weight_dtype="):
        LLM("random:tiny-llama", quantized_matmul=hook)
    with pytest.raises(ValueError, match=r"quantized_matmul=_one_argument\(x2d\) cannot be called as "
                                         r"quantized_matmul\(x, layer\)"):
        llm.with_levers(quantized_matmul=_one_argument)
    with pytest.raises(ValueError, match=r"the plugged quantized matmul returned \(\d+, 3\)"):
        llm.with_levers(quantized_matmul=lambda x2d, layer: x2d[:, :3]).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref   # the engine serves on


def _one_argument(x2d):
    return x2d
