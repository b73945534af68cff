"""Learned int4 rounding (minillm/quant/autoround.py, weight_calibration="autoround") and its
on-disk calibration cache."""

import pytest
import torch
from test_gptq import correlated_inputs, output_error

from minillm import LLM, EngineConfig
from minillm.layers.attention import AttentionMetadata
from minillm.models import quantize as quantize_module
from minillm.models.calibrate import cache as cache_module
from minillm.models.quantize import calibrate_autoround, calibrate_awq, quantize_model
from minillm.quant import QuantizedLinear, dequantize_int4
from minillm.quant.int4 import unpack_int4
from minillm.quant.awq import fake_quantize
from minillm.quant.autoround import RANGE_LIMITS, SHIFT_LIMIT, LearnableInt4
from minillm.sampling import SamplingParams


def test_learnable_int4_starts_at_round_to_nearest_and_exports_what_quantized_linear_stores():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 72, generator=g)              # 72 inputs: groups of 32 pad to 96
    learner = LearnableInt4(w, 32)
    assert torch.allclose(learner.weight(), fake_quantize(w, "int4", 32), atol=1e-5)
    s = torch.rand(72, generator=g) + 0.5
    learner = LearnableInt4(w, 32, input_scale=s)
    q, scale, zero = learner.export()
    assert q.dtype == torch.uint8 and q.shape == (24, 96) and int(q.max()) <= 15
    assert scale.shape == zero.shape == (24, 3)
    assert torch.equal(scale, scale.to(torch.bfloat16).float()) and torch.equal(zero, zero.to(torch.bfloat16).float())
    layer = QuantizedLinear.from_float(w, None, "int4", 32, input_scale=s, quantized=(q, scale, zero))
    stored = dequantize_int4(q, scale, zero)[:, :72]   # the levels of w * s; the layer multiplies x / s by them
    assert torch.allclose(layer.dequantized_weight().float(), stored, rtol=1e-2, atol=1e-2)
    assert torch.allclose(learner.stored_weight(), stored / s)   # what calibrate_autoround feeds the next layer
    # The exported grid is the learner's own, up to bf16 rounding of scale and zero (a weight at a
    # rounding boundary may land one level over).
    diff = (learner.weight().detach() - stored / s).abs()
    assert float(diff.mean()) < 0.03 * float(w.abs().mean()), float(diff.mean())


def test_sign_steps_lower_a_matrix_output_error_and_stay_in_range():
    x = correlated_inputs(512, 128, seed=3)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(4))
    learner = LearnableInt4(w, 64)
    start = learner.state()
    steps = 100
    for step in range(steps):
        loss = (x @ learner.weight().t() - x @ w.t()).pow(2).mean()
        loss.backward()
        learner.sign_step(0.1 * (1 - step / steps) / steps)
    learned, rtn = learner.weight().detach(), fake_quantize(w, "int4", 64)
    assert output_error(learned, w, x) < 0.95 * output_error(rtn, w, x)
    assert 0 < float(learner.v.detach().abs().max()) <= 0.5
    assert RANGE_LIMITS[0] <= float(learner.a.detach().min()) and float(learner.a.detach().max()) <= RANGE_LIMITS[1]
    assert float(learner.b.detach().abs().max()) <= SHIFT_LIMIT
    assert all(p.grad is None for p in learner.parameters())
    learner.load_state(start)                         # back to round-to-nearest
    assert torch.allclose(learner.weight(), rtn, atol=1e-5)


def llm_like_tiny_model():
    llm = LLM("random:tiny-llama", max_num_seqs=2)
    model = llm.engine.model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # correlated channels, a few large ones (as test_gptq does)
        e = model.embed_tokens.weight
        e.copy_(e @ (torch.randn(64, 64, generator=g) / 8))
        e[:, :4] *= 6
    return llm, model


def model_output(model, ids):
    meta = AttentionMetadata(query_lens=[len(ids)], num_cached=[0], slot_mapping=None, use_cache=False)
    with torch.inference_mode():   # a pass without a pool: torch attention
        return model(ids, torch.arange(len(ids)), meta)


def test_autoround_brings_a_random_model_closer_than_awq_and_leaves_it_as_it_was():
    llm, model = llm_like_tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(6)
    calib = torch.randint(0, model.cfg.vocab_size, (2048,), generator=g).tolist()
    scales, parts = calibrate_autoround(model, calib, 32, steps=40, batch_tokens=512, seq_len=256, head_group_size=32,
                                        progress=False)
    keys = {f"layers.{i}.{n}" for i in range(model.cfg.num_layers) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert set(parts) == set(scales) | {"lm_head"} and set(scales) == keys
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(p.requires_grad and p.grad is not None for p in model.parameters())
    awq_scales, awq_clips = calibrate_awq(model, calib[:512], "int4", 32, progress=False)
    learned = quantize_model(model, "int4", 32, in_place=False, input_scales=scales, quantized=parts, head_dtype=None)
    awq = quantize_model(model, "int4", 32, in_place=False, input_scales=awq_scales, clips=awq_clips, head_dtype=None)
    ids = torch.randint(0, model.cfg.vocab_size, (256,), generator=g)   # tokens the calibration did not see
    ref, got, base = (model_output(m, ids) for m in (model, learned, awq))
    err_learned, err_awq = float((got - ref).pow(2).mean()), float((base - ref).pow(2).mean())
    assert err_learned < 0.85 * err_awq, (err_learned, err_awq)   # 0.75 when written
    _, plain_parts = calibrate_autoround(model, calib, 32, steps=40, batch_tokens=512, seq_len=256, relative=False,
                                         progress=False)   # the plain mean squared error: also beats AWQ
    plain = quantize_model(model, "int4", 32, in_place=False, input_scales=scales, quantized=plain_parts, head_dtype=None)
    err_plain = float((model_output(plain, ids) - ref).pow(2).mean())
    assert err_plain < 0.85 * err_awq and not torch.equal(plain_parts["layers.0.qkv_proj"][0], parts["layers.0.qkv_proj"][0])
    # The head's GPTQ (on the int4 layers' final stream) beats rounding it to nearest, on the logits.
    body = {k: v for k, v in parts.items() if k != "lm_head"}
    heads = [quantize_model(model, "int4", 32, in_place=False, input_scales=scales, quantized=q, head_group_size=32)
             for q in (parts, body)]
    with torch.inference_mode():
        ref_logits = model.compute_logits(ref)
        gptq_err, rtn_err = (float((m.compute_logits(model_output(m, ids)) - ref_logits).pow(2).mean()) for m in heads)
    assert gptq_err < 0.75 * rtn_err, (gptq_err, rtn_err)   # 0.51 when written


def test_autoround_lever_calibrates_once_and_reads_the_cache_after(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "calibration_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cache_module, "AUTOROUND_STEPS", 4)
    monkeypatch.setattr(cache_module, "E2E_STEPS", 2)
    levers = dict(weight_dtype="int4", weight_group_size=32, weight_calibration="autoround")
    float_model = LLM("random:tiny-llama", max_num_seqs=2).engine.model
    assert not quantize_module.autoround_is_cached(float_model, None, 32)
    llm = LLM("random:tiny-llama", max_num_seqs=2, **levers)
    files = list(tmp_path.glob("autoround-tuned-*.pt"))   # the lever's entry; AutoRound's own stage beside it
    assert len(files) == 1 and len(list(tmp_path.glob("autoround-*.pt"))) == 2
    assert quantize_module.autoround_is_cached(float_model, None, 32)
    assert not quantize_module.autoround_is_cached(float_model, None, 64)
    first = llm.engine.model.layers[0].qkv_proj
    assert first.inv_input_scale is not None
    # down_proj's input is rotated within each group of 32 (test_rotate.py); the float model is not
    assert llm.engine.model.layers[1].down_rotation.shape == (32, 32) and float_model.layers[1].down_rotation is None

    def must_not_run(*args, **kwargs):
        raise AssertionError("the cached calibration should have been read")

    monkeypatch.setattr(cache_module, "calibrate_autoround", must_not_run)
    monkeypatch.setattr(cache_module, "tune_int4_grids", must_not_run)
    again = LLM("random:tiny-llama", max_num_seqs=2, **levers).engine.model.layers[0].qkv_proj
    assert torch.equal(again.dequantized_weight(), first.dequantized_weight())
    # The same entry serves the int4 head: its GPTQ'd matrix was stored beside the layers (int8 head above).
    saved = torch.load(files[0], weights_only=True)["parts"]["lm_head"]
    head4 = LLM("random:tiny-llama", max_num_seqs=2, weight_head_dtype="int4", **levers).engine.model.quantized_head
    assert head4.weight_dtype == "int4" and llm.engine.model.quantized_head.weight_dtype == "int8"
    assert torch.equal(head4.dequantized_weight(), dequantize_int4(unpack_int4(saved[0]), *saved[1:])[:, :64].to(torch.float32))
    # Another recipe (more steps) is another cache entry, not a stale read.
    monkeypatch.setattr(cache_module, "AUTOROUND_STEPS", 5)
    with pytest.raises(AssertionError, match="cached calibration"):
        LLM("random:tiny-llama", max_num_seqs=2, **levers)
    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_autoround_checks_its_inputs():
    with pytest.raises(ValueError, match=r"weight_calibration='autoround' needs weight_dtype='int4' \(got 'int8'\)"):
        EngineConfig(weight_dtype="int8", weight_calibration="autoround")
    model = LLM("random:tiny-llama", max_num_seqs=2).engine.model
    with pytest.raises(ValueError, match=r"steps=0, batch_tokens=1024 and seq_len=512 must each be >= 1"):
        calibrate_autoround(model, [1, 2, 3], steps=0)
    with pytest.raises(ValueError, match=r"at least 2 calibration tokens, got 1"):
        calibrate_autoround(model, [1])
    with pytest.raises(ValueError, match=r"clip has shape \(2, 1, 2\), expected \(2, 2, 2\)"):
        LearnableInt4(torch.randn(2, 64), 32, clip=torch.zeros(2, 1, 2))


def next_token_kl(model, quantized, ids):
    """Mean KL(float || quantized) of the next-token distributions over ids (one sequence)."""
    with torch.inference_mode():
        ref = torch.log_softmax(model.compute_logits(model_output(model, ids)), -1)
        got = torch.log_softmax(quantized.compute_logits(model_output(quantized, ids)), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def test_tuning_the_grids_end_to_end_lowers_the_kl_on_unseen_tokens_and_keeps_the_levels():
    llm, model = llm_like_tiny_model()
    with torch.no_grad():
        model.norm.weight.mul_(8)   # sharper next-token distributions than a random model's near-uniform ones
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    calib = torch.randint(0, model.cfg.vocab_size, (8192,), generator=g).tolist()   # 2,048 are fitted too closely
    scales, parts = calibrate_autoround(model, calib, 32, steps=10, batch_tokens=512, seq_len=256, progress=False)
    same_scales, tuned = quantize_module.tune_int4_grids(model, calib, scales, parts, steps=40, lr=1e-2,
                                                         batch_tokens=512, seq_len=256, progress=False)
    assert set(tuned) == set(parts) and same_scales.keys() == scales.keys()
    assert all(torch.equal(same_scales[k], scales[k]) for k in scales)   # not tuned unless asked
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(p.grad is not None for p in model.parameters())
    changed = 0
    for key, (q, scale, zero) in tuned.items():
        assert torch.equal(q, parts[key][0])                       # the levels stay; only the grids move
        assert torch.equal(scale, scale.to(torch.bfloat16).float()) and torch.equal(zero, zero.to(torch.bfloat16).float())
        changed += int((scale != parts[key][1]).sum() + (zero != parts[key][2]).sum())
    assert changed > 0
    ids = torch.randint(0, model.cfg.vocab_size, (256,), generator=g)   # tokens neither step saw
    kl = [next_token_kl(model, quantize_model(model, "int4", 32, in_place=False, input_scales=scales, quantized=p,
                                              head_dtype=None), ids) for p in (parts, tuned)]
    assert kl[1] < 0.9 * kl[0], kl   # 0.87 when written (the calibration tokens themselves: 0.70)
    # The input scales learned too, against the int8 head the engine serves: lower still on that model.
    new_scales, tuned_s = quantize_module.tune_int4_grids(model, calib, scales, parts, steps=40, lr=1e-2,
                                                          batch_tokens=512, seq_len=256, tune_input_scales=True,
                                                          head_dtype="int8", progress=False)
    moved = [float((new_scales[k] / scales[k] - 1).abs().max()) for k in scales]
    assert min(moved) > 0 and max(moved) < 0.5, moved     # every matrix's scale moved (4-13% at most when written)
    assert all(torch.equal(q, parts[key][0]) for key, (q, _, _) in tuned_s.items())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    kl8 = [next_token_kl(model, quantize_model(model, "int4", 32, in_place=False, input_scales=s, quantized=p,
                                               head_dtype="int8"), ids)
           for s, p in ((scales, parts), (scales, tuned), (new_scales, tuned_s))]
    assert kl8[2] < 0.95 * kl8[1] and kl8[1] < kl8[0], kl8   # 0.89 and 0.88 when written
    with pytest.raises(ValueError, match=r"int4 parts for every decoder matrix; missing \['layers.0.qkv_proj'"):
        quantize_module.tune_int4_grids(model, calib, scales, {}, progress=False)
    with pytest.raises(ValueError, match=r"steps=0, batch_tokens=2048 and seq_len=512 must each be >= 1"):
        quantize_module.tune_int4_grids(model, calib, scales, parts, steps=0, progress=False)
    with pytest.raises(ValueError, match=r"tune_int4_grids\(head_dtype='int4'\): the student's head is None"):
        quantize_module.tune_int4_grids(model, calib, scales, parts, head_dtype="int4", progress=False)
