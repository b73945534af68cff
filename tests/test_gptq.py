"""GPTQ int4 (minillm/quant/gptq.py, weight_calibration="gptq") and the tied embedding served
from the quantized head's storage (QuantizedLinear.rows, LlamaForCausalLM.embed)."""

import dataclasses
import platform

import pytest
import torch
import torch.nn.functional as F

from minillm import LLM, EngineConfig
from minillm.bench.memory import weight_bytes as formula_bytes
from minillm.models.presets import PRESETS, preset_config
from minillm.models.quantize import calibrate_gptq, quantize_model
from minillm.quant import QuantizedLinear, dequantize_int4, quantize_int4
from minillm.quant.gptq import gptq_int4, input_hessian
from minillm.quant import int4pack
from minillm.sampling import SamplingParams


def correlated_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    """Inputs whose channels are correlated (a random mixing) with a few large channels, as in an LLM."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5)
    x = x + 0.1 * torch.randn(t, k, generator=g)
    x[:, :6] *= 8
    return x


def output_error(w_q: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> float:
    return float((x @ w_q.t() - x @ w.t()).pow(2).mean())


@pytest.mark.parametrize("act_order", [False, True, "static"])
def test_gptq_beats_round_to_nearest_on_the_layer_output_and_stays_on_the_int4_grid(act_order):
    g = torch.Generator().manual_seed(1)
    n, k, group = 96, 320, 128  # 320 inputs pad to 384 (3 groups), as QuantizedLinear pads
    w = torch.randn(n, k, generator=g) * 0.02
    x = correlated_inputs(1024, k, 2)
    q, scale, zero = gptq_int4(w, input_hessian(x), group, act_order=act_order)
    assert q.dtype == torch.uint8 and q.shape == (n, 384) and int(q.max()) <= 15
    assert scale.shape == zero.shape == (n, 3)
    # Scales and zeros are what QuantizedLinear stores (bf16), so its matrix is exactly this one.
    assert torch.equal(scale, scale.to(torch.bfloat16).float()) and torch.equal(zero, zero.to(torch.bfloat16).float())
    assert torch.all(q[:, k:] == torch.round(-zero[:, 2:3] / scale[:, 2:3]).clamp(0, 15))  # padded zeros
    w_gptq = dequantize_int4(q, scale, zero)[:, :k]
    w_rtn = dequantize_int4(*quantize_int4(F.pad(w, (0, 64)), group))[:, :k]
    gptq_err, rtn_err = output_error(w_gptq, w, x), output_error(w_rtn, w, x)
    assert gptq_err < 0.5 * rtn_err, (gptq_err, rtn_err)
    # Deterministic: the same inputs give the same bytes.
    again = gptq_int4(w, input_hessian(x), group, act_order=act_order)
    assert all(torch.equal(a, b) for a, b in zip((q, scale, zero), again))
    # QuantizedLinear stores the given levels unchanged on every path, and multiplies by that matrix.
    for fast in (True, False):
        layer = QuantizedLinear.from_float(w, None, "int4", group, fast=fast, quantized=(q, scale, zero))
        assert torch.equal(layer.dequantized_weight(), w_gptq), layer.path
        assert torch.equal(layer.rows(torch.arange(n)), w_gptq), layer.path


def test_gptq_checks_its_inputs():
    w = torch.randn(16, 64)
    with pytest.raises(ValueError, match=r"hessian has shape \(32, 32\), expected \(64, 64\)"):
        gptq_int4(w, torch.eye(32), 32)
    with pytest.raises(ValueError, match="damp=1.5 must be in"):
        gptq_int4(w, torch.eye(64), 32, damp=1.5)
    with pytest.raises(ValueError, match=r"quantized= parts q \(16, 32\)"):
        QuantizedLinear.from_float(w, None, "int4", 32, quantized=(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1),
                                                         torch.zeros(16, 1)))
    with pytest.raises(ValueError, match=r"int4 levels are 0..15"):
        QuantizedLinear.from_float(w, None, "int4", 32, quantized=(torch.full((16, 64), 16, dtype=torch.uint8),
                                                         torch.ones(16, 2), torch.zeros(16, 2)))
    with pytest.raises(ValueError, match=r"weight_calibration='gptq' needs weight_dtype='int4' \(got 'int8'\)"):
        EngineConfig(weight_dtype="int8", weight_calibration="gptq")


# ------------------------------------------------------------------ the embedding from the quantized head
@pytest.mark.parametrize("wd", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("n, k, group", [(96, 200, 32), (64, 256, 128), (48, 128, 64)])
def test_rows_are_the_dequantized_rows_on_every_path(wd, n, k, group):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    ids = torch.tensor([[0, 5, n - 1], [3, 3, 17]])
    for fast in (True, False):
        layer = QuantizedLinear.from_float(w, None, wd, group, fast=fast)
        want = layer.dequantized_weight()[ids]
        assert torch.equal(layer.rows(ids), want), (wd, layer.path)
        if layer.path == "dequant" and wd != "fp8":  # the CUDA path stores the same plain buffers
            layer.path = "triton"
            assert torch.equal(layer.rows(ids), want), (wd, "triton")
    if wd == "int4":
        packed = QuantizedLinear.from_float(w, None, wd, group)
        if packed.path == "int4pack":  # gathered from the kernel's layout, no plain copy made
            if platform.machine() in ("x86_64", "AMD64"):  # torch packs in blocks of 32 (AVX2) or 64 (AVX-512)
                assert int4pack.block_n() in (32, 64)
            if int4pack.block_n():
                packed.rows(ids)
                assert packed._int4_cache is None


def tied_preset(monkeypatch) -> str:
    monkeypatch.setitem(PRESETS, "tiny-llama-tied", dataclasses.replace(PRESETS["tiny-llama"], tie_word_embeddings=True))
    return "tiny-llama-tied"


@pytest.mark.parametrize("wd, group, head", [("int8", 128, "auto"), ("int4", 32, "auto"), ("int4", 128, "auto"),
                                             ("int4", 128, "int4")])
def test_a_tied_quantized_model_keeps_one_copy_of_the_embedding(wd, group, head, monkeypatch):
    name = tied_preset(monkeypatch)
    cfg = preset_config(name)
    base = LLM(f"random:{name}", max_num_seqs=2)
    q = base.with_levers(weight_dtype=wd, weight_group_size=group, weight_head_dtype=head)
    model, qhead = q.engine.model, q.engine.model.quantized_head
    assert model.embed_tokens is None and base.engine.model.embed_tokens is not None  # the donor keeps its table
    assert not any(p.shape == (cfg.vocab_size, cfg.hidden_size) for p in model.parameters())  # no float table left
    ids = torch.tensor([0, 7, 7, cfg.vocab_size - 1])
    assert torch.equal(model.embed(ids), qhead.dequantized_weight()[ids])
    assert (qhead.weight_dtype, qhead.group_size if qhead.weight_dtype == "int4" else None) == \
        (("int4", 32) if head == "int4" else ("int8", None))
    # Bytes: the decoder matrices, the head once, the norms in fp32 (the formula of bench/memory.py).
    assert q.weight_bytes == formula_bytes(cfg, wd, group, float_dtype="float32", head_dtype=head)
    v, h = cfg.vocab_size, cfg.hidden_size
    hg = qhead.group_size
    head_bytes = v * h + 4 * v if qhead.weight_dtype == "int8" else v * (h + (-h) % hg) // 2 + 4 * v * ((h + (-h) % hg) // hg)
    assert q.weight_bytes == sum(m.quantized_bytes() for m in model.modules() if isinstance(m, QuantizedLinear)) \
        + 4 * (2 * cfg.num_layers + 1) * h
    assert qhead.quantized_bytes() == head_bytes
    out = q.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


# ------------------------------------------------------------------ the lever on a tiny model
def test_gptq_lever_on_a_random_model_brings_the_output_closer_than_round_to_nearest():
    from minillm.layers.attention import AttentionMetadata

    llm = LLM("random:tiny-llama", max_num_seqs=2)
    model = llm.engine.model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # LLM-like inputs: correlated channels, a few large ones (random ones are isotropic,
        e = model.embed_tokens.weight  # where no calibration can beat round-to-nearest)
        e.copy_(e @ (torch.randn(64, 64, generator=g) / 8))
        e[:, :4] *= 6
    calib = torch.randint(0, model.cfg.vocab_size, (512,), generator=g).tolist()
    scales, parts = calibrate_gptq(model, calib, 32, progress=False)
    assert set(parts) == {f"layers.{i}.{n}" for i in range(model.cfg.num_layers)
                          for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} == set(scales)
    gptq = quantize_model(model, "int4", 32, in_place=False, input_scales=scales, quantized=parts, head_dtype=None)
    rtn = quantize_model(model, "int4", 32, in_place=False, head_dtype=None)
    ids = torch.randint(0, model.cfg.vocab_size, (128,), generator=g)  # other tokens than the calibration's
    meta = AttentionMetadata(query_lens=[128], num_cached=[0], slot_mapping=None, use_cache=False)
    outs = []
    for m in (model, gptq, rtn):   # passes without a pool: torch attention
        with torch.inference_mode():
            outs.append(m(ids, torch.arange(128), meta))
    ref, got, base = outs
    err_gptq, err_rtn = float((got - ref).pow(2).mean()), float((base - ref).pow(2).mean())
    assert err_gptq < 0.75 * err_rtn, (err_gptq, err_rtn)
    # Through the engine: the lever builds the same kind of model and generates.
    q = llm.with_levers(weight_dtype="int4", weight_group_size=32, weight_calibration="gptq")
    served = q.engine.model.layers[0]
    assert served.qkv_proj.inv_input_scale is not None
    # down_proj's input and the norm outputs are rotated first (test_rotate.py); the engine's float model is not
    assert served.down_rotation.shape == (32, 32) and served.post_attention_layernorm.rotation.shape == (32, 32)
    donor = llm.engine.model.layers[0]
    assert donor.down_rotation is None and donor.input_layernorm.rotation is None
    out = q.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_gptq_lever_with_an_int4_head_calibrates_the_head_too(monkeypatch):
    name = tied_preset(monkeypatch)
    llm = LLM(f"random:{name}", max_num_seqs=2, weight_dtype="int4", weight_calibration="gptq",
              weight_head_dtype="int4")
    model = llm.engine.model
    head = model.quantized_head
    assert model.embed_tokens is None and head.weight_dtype == "int4" and head.group_size == 32
    assert head.inv_input_scale is None  # the embedding is looked up in its rows
    rtn = LLM(f"random:{name}", max_num_seqs=2, weight_dtype="int4", weight_head_dtype="int4").engine.model
    # Same float weights (a random preset is seeded), other levels: the head was GPTQ'd, not rounded to nearest.
    floats = [LLM(f"random:{name}", max_num_seqs=2).engine.model.embed_tokens.weight for _ in range(2)]
    assert torch.equal(*floats)
    assert not torch.equal(head.dequantized_weight(), rtn.quantized_head.dequantized_weight())
    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_gptq_tuned_lever_calibrates_once_then_reads_its_cache_and_serves_both_heads(tmp_path, monkeypatch):
    from minillm.models import quantize as quantize_module
    from minillm.models.calibrate import cache as cache_module
    from minillm.quant.int4 import unpack_int4

    monkeypatch.setattr(cache_module, "calibration_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cache_module, "E2E_STEPS", 3)
    levers = dict(weight_dtype="int4", weight_group_size=32, weight_calibration="gptq-tuned")
    float_model = LLM("random:tiny-llama", max_num_seqs=2).engine.model
    path = quantize_module.gptq_tuned_cache_path(float_model, None, 32)
    assert not path.exists()
    llm = LLM("random:tiny-llama", max_num_seqs=2, **levers)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    served = llm.engine.model.layers[0]
    assert served.down_rotation.shape == (32, 32) and served.input_layernorm.rotation.shape == (32, 32)
    assert float_model.layers[0].down_rotation is None and float_model.layers[0].input_layernorm.rotation is None
    # The input scales were tuned: they are not the GPTQ stage's AWQ scales (same model, tokens and recipe).
    rotated = quantize_module.int4_rotated(float_model, 32)
    ids = quantize_module.autoround_token_ids(None, vocab_size=rotated.cfg.vocab_size)
    gptq_scales, _ = calibrate_gptq(rotated, ids[:quantize_module.GPTQ_TOKENS], 32, act_order="static", clip=True,
                                    progress=False)
    saved = torch.load(path, weights_only=True)
    assert saved["scales"].keys() == gptq_scales.keys()
    assert all(not torch.equal(saved["scales"][k], gptq_scales[k]) for k in gptq_scales)
    assert torch.allclose(served.qkv_proj.inv_input_scale, 1 / saved["scales"]["layers.0.qkv_proj"])

    def must_not_run(*args, **kwargs):
        raise AssertionError("the cached calibration should have been read")

    monkeypatch.setattr(cache_module, "calibrate_gptq", must_not_run)
    monkeypatch.setattr(cache_module, "tune_int4_grids", must_not_run)
    again = LLM("random:tiny-llama", max_num_seqs=2, **levers).engine.model
    assert torch.equal(again.layers[0].qkv_proj.dequantized_weight(), served.qkv_proj.dequantized_weight())
    assert again.quantized_head.weight_dtype == "int8"
    head4 = LLM("random:tiny-llama", max_num_seqs=2, weight_head_dtype="int4", **levers).engine.model.quantized_head
    q, scale, zero = saved["parts"]["lm_head"]   # the int4 head's GPTQ, stored in the same entry
    assert head4.weight_dtype == "int4"
    assert torch.equal(head4.dequantized_weight(), dequantize_int4(unpack_int4(q), scale, zero)[:, :64].float())
    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
