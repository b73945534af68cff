"""int4 calibration: AWQ's clipping search, the lm_head rule, and the calibration text kept apart
from the text the quality harness scores."""

import re

import pytest
import torch

from minillm.models.quantize import (CALIBRATION_TEXT, GENERATED_CALIBRATION_TEXT, HEAD_DTYPES, clip_weight,
                                    head_dtype_for, quantize_model)
from minillm.quant import QuantizedLinear
from minillm.quant.awq import fake_quantize, search_clip


def _output_error(w_q, w, x):
    return float((x @ w_q.t() - x @ w.t()).pow(2).mean())


def test_clip_search_never_loses_to_round_to_nearest_and_wins_on_outlying_weights():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g) * 0.02
    w[torch.rand(w.shape, generator=g) < 0.01] *= 12  # a few outlying weights stretch their groups
    x = torch.randn(200, 256, generator=g)
    clip, err = search_clip(w, x, 128)
    assert clip.shape == (48, 2, 2) and err.shape == (48, 2)
    absmax = w.reshape(48, 2, 128).abs().amax(-1)
    torch.testing.assert_close(clip[..., 0], -clip[..., 1])  # AWQ's search: [-m, m]
    m = clip[..., 1]
    assert torch.all(m <= absmax + 1e-7) and torch.all(m >= 0.5 * absmax - 1e-7)
    # Per group, the search's error equals the error of the clipped group computed directly.
    clipped = clip_weight(w, None, clip, 128)
    d = (fake_quantize(clipped, "int4", 128) - w).reshape(48, 2, 128)
    xg = x.reshape(200, 2, 128)
    direct = torch.einsum("tgk,ngk->tng", xg, d).pow(2).mean(0)
    torch.testing.assert_close(err, direct, rtol=1e-3, atol=1e-9)
    rtn = _output_error(fake_quantize(w, "int4", 128), w, x)
    got = _output_error(fake_quantize(clipped, "int4", 128), w, x)
    assert got < 0.9 * rtn, (got, rtn)
    assert bool((m < absmax - 1e-7).any())
    # Two-sided (asymmetric int4): low and high move apart, inside the group's own range, and
    # the least error over a grid that contains the symmetric search's "no clip" point.
    clip2s, err2s = search_clip(w, x, 128, two_sided=True)
    lo, hi = w.reshape(48, 2, 128).amin(-1), w.reshape(48, 2, 128).amax(-1)
    assert torch.all(clip2s[..., 0] >= lo - 1e-7) and torch.all(clip2s[..., 1] <= hi + 1e-7)
    assert torch.all(clip2s[..., 0] <= lo + 0.25 * (hi - lo) + 1e-6)
    got2s = _output_error(fake_quantize(clip_weight(w, None, clip2s, 128), "int4", 128), w, x)
    assert got2s < 0.9 * rtn, (got2s, rtn)
    # No outliers to cut: clipping never does worse than round-to-nearest on the calibration inputs.
    w2 = torch.randn(32, 128, generator=g)
    clip2, _ = search_clip(w2, x[:, :128], 128)
    assert _output_error(fake_quantize(clip_weight(w2, None, clip2, 128), "int4", 128), w2, x[:, :128]) <= \
        _output_error(fake_quantize(w2, "int4", 128), w2, x[:, :128]) * (1 + 1e-5)
    with pytest.raises(ValueError, match="max_shrink=1.0"):
        search_clip(w, x, 128, max_shrink=1.0)


def test_clip_weight_clamps_in_the_scaled_domain_and_pads_odd_widths():
    w = torch.tensor([[1.0, -4.0, 2.0], [0.5, 0.5, -0.5]])
    s = torch.tensor([2.0, 1.0, 1.0])
    clip = torch.tensor([[[-1.5, 1.5], [-9.0, 9.0]], [[-0.25, 0.25], [-0.3, 0.3]]])  # groups of 2, 3 columns padded to 4
    got = clip_weight(w, s, clip, 2)
    # scaled row 0: [2, -4 | 2] -> clamp +-1.5 -> [1.5, -1.5 | 2] (second group: +-9) -> / s
    torch.testing.assert_close(got, torch.tensor([[0.75, -1.5, 2.0], [0.125, 0.25, -0.3]]))
    lopsided = torch.tensor([[[-1.0, 3.0], [0.0, 1.0]], [[0.4, 0.45], [-9.0, 9.0]]])
    torch.testing.assert_close(clip_weight(w, None, lopsided, 2),
                               torch.tensor([[1.0, -1.0, 1.0], [0.45, 0.45, -0.5]]))


def test_head_dtype_rule():
    assert head_dtype_for("int4") == "int8"        # 4-bit body, 8-bit head (AWQ / GPTQ keep the head out of 4-bit)
    assert head_dtype_for("int8") == "int8" and head_dtype_for("fp8") == "fp8"
    assert head_dtype_for(None) is None and head_dtype_for("int4", "model") is None
    assert head_dtype_for("int4", "int4") == "int4" and head_dtype_for("int8", "fp8") == "fp8"
    with pytest.raises(ValueError, match=r"weight_head_dtype='int2' is not one of \('auto', 'model'"):
        head_dtype_for("int4", "int2")
    assert HEAD_DTYPES[:2] == ("auto", "model")


def test_quantize_model_head_options():
    from minillm import LLM

    llm = LLM("random:tiny-llama")
    model = llm.engine.model
    float_head = model.lm_head_weight.clone()
    kept = quantize_model(model, "int4", 32, in_place=False, head_dtype=None)
    assert kept.quantized_head is None and torch.equal(kept.lm_head_weight, float_head)
    assert isinstance(kept.layers[0].o_proj, QuantizedLinear)
    int8 = quantize_model(model, "int4", 32, in_place=False, head_dtype="int8")
    assert int8.quantized_head.weight_dtype == "int8" and int8.layers[0].o_proj.weight_dtype == "int4"
    same = quantize_model(model, "int4", 32, in_place=False)
    assert same.quantized_head.weight_dtype == "int4"
    assert llm.with_levers(weight_dtype="int4").engine.model.quantized_head.weight_dtype == "int8"


@pytest.mark.parametrize("text", [CALIBRATION_TEXT, GENERATED_CALIBRATION_TEXT], ids=lambda p: p.name)
def test_calibration_text_is_not_the_scored_corpus(text):
    corpus = (CALIBRATION_TEXT.parent / "corpus.txt").read_text()
    calibration = text.read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", calibration) if len(s.strip()) > 40]
    assert len(sentences) > 20
    shared = [s for s in sentences if s in corpus]
    assert not shared, shared
    words = corpus.split()
    grams = {" ".join(words[i:i + 8]) for i in range(len(words) - 7)}
    cw = calibration.split()
    assert not any(" ".join(cw[i:i + 8]) in grams for i in range(len(cw) - 7))


def test_weight_head_dtype_lever():
    from minillm import LLM
    from minillm.config import EngineConfig

    with pytest.raises(ValueError, match=r"weight_head_dtype='int2' is not one of \('auto', 'model', 'int8', 'int4', 'fp8'\)"):
        EngineConfig(weight_dtype="int4", weight_head_dtype="int2")
    with pytest.raises(ValueError, match=r"weight_head_dtype='int8' needs a weight_dtype"):
        EngineConfig(weight_head_dtype="int8")
    base = LLM("random:tiny-llama", max_num_seqs=2)
    float_head = base.engine.model.lm_head_weight
    kept = base.with_levers(weight_dtype="int4", weight_group_size=32, weight_head_dtype="model")
    assert kept.engine.model.quantized_head is None and torch.equal(kept.engine.model.lm_head_weight, float_head)
    int4 = base.with_levers(weight_dtype="int4", weight_group_size=32, weight_head_dtype="int4")
    assert int4.engine.model.quantized_head.weight_dtype == "int4"
    auto = base.with_levers(weight_dtype="int4", weight_group_size=32)
    assert auto.engine.model.quantized_head.weight_dtype == "int8"
    assert len({id(m.engine.model) for m in (kept, int4, auto)}) == 3  # the head is part of the weight format
    # Untied head [512, 64]: kept in fp32, or an int8 copy (+ fp32 row scales), or int4 groups of 32.
    assert kept.weight_bytes - auto.weight_bytes == 512 * 64 * 4 - (512 * 64 + 4 * 512)
    assert auto.weight_bytes - int4.weight_bytes == (512 * 64 + 4 * 512) - (512 * 32 + 4 * 512 * 2)
    from minillm.bench.memory import weight_bytes

    cfg = base.model_config
    for llm, head in [(kept, "model"), (int4, "int4"), (auto, "auto")]:
        assert llm.weight_bytes == weight_bytes(cfg, "int4", 32, "float32", head_dtype=head), head
