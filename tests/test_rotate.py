"""Hadamard rotation of down_proj's input and of the norm outputs (minillm/quant/rotate.py;
rotate_down_proj, rotate_norm_outputs and int4_rotated in minillm/models/calibrate/rotate.py). The first
step of weight_calibration="autoround" (down_proj's input) and "gptq" (both)."""

import pytest
import torch

from minillm import LLM
from minillm.layers.attention import AttentionMetadata
from minillm.models.quantize import (down_rotated, int4_rotated, norm_rotation_block, quantize_model, rotate_down_proj,
                                     rotate_norm_outputs, rotation_block, shallow_copy)
from minillm.quant import dequantize_int4, quantize_int4
from minillm.quant.rotate import hadamard, rotate_blocks
from minillm.sampling import SamplingParams


def greedy_tokens(llm) -> list[list[int]]:
    """Two prompts' greedy tokens: a rotation that keeps the float model keeps them."""
    prompts = [{"prompt_token_ids": [1, 7, 30, 99, 4]}, {"prompt_token_ids": [1, 250, 3]}]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))]


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128])
def test_hadamard_is_orthonormal_with_entries_of_one_size(n):
    h = hadamard(n, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))


@pytest.mark.parametrize("n", [0, 3, 96, 2.0])
def test_hadamard_rejects_sizes_that_are_not_powers_of_two(n):
    with pytest.raises(ValueError, match=f"n={n!r}.*power of two"):
        hadamard(n)


def test_rotate_blocks_is_a_block_diagonal_product_and_checks_the_width():
    g = torch.Generator().manual_seed(3)
    x, h = torch.randn(5, 96, generator=g, dtype=torch.float64), hadamard(32, torch.float64)
    assert torch.allclose(rotate_blocks(x, h), x @ torch.block_diag(h, h, h))
    assert torch.allclose(rotate_blocks(rotate_blocks(x, h), h.T), x)   # undone by the transpose
    with pytest.raises(ValueError, match="100 channels are not a multiple of the block size 32"):
        rotate_blocks(torch.randn(2, 100), h)


def test_rotation_shrinks_int4_error_on_rows_with_outliers_and_not_on_gaussian_rows():
    """Heavy-tailed rows (a few weights far out stretch a group's range): rotated within each group
    of 128, round-to-nearest int4 loses less of the product x W^T, on fresh random inputs (about a
    fifth when written). Gaussian rows stay Gaussian under the rotation: no gain, no loss."""
    g = torch.Generator().manual_seed(7)
    heavy = torch.randn(256, 1024, generator=g) * torch.exp(torch.randn(256, 1024, generator=g))
    gaussian = torch.randn(256, 1024, generator=g)
    x = torch.randn(64, 1024, generator=g)
    h = hadamard(128)

    def ratio(w):
        plain = dequantize_int4(*quantize_int4(w, 128))
        rotated = rotate_blocks(dequantize_int4(*quantize_int4(rotate_blocks(w, h), 128)), h.T)
        err_plain, err_rotated = ((x @ (v - w).T).pow(2).mean() for v in (plain, rotated))
        return float(err_rotated / err_plain)

    assert ratio(heavy) < 0.4
    assert 0.9 < ratio(gaussian) < 1.1


def test_rotate_down_proj_keeps_the_float_model_and_leaves_the_donor_alone():
    llm = LLM("random:tiny-llama", max_num_seqs=2)
    model = llm.engine.model
    before = model.layers[0].down_proj.weight.clone()
    reference = greedy_tokens(llm)
    assert rotation_block(model, 128) == 128 and rotation_block(model, 32) == 32
    copy = rotate_down_proj(shallow_copy(model), 32)
    assert copy is not model and model.layers[0].down_rotation is None
    assert torch.equal(model.layers[0].down_proj.weight, before)
    assert copy.layers[1].down_rotation.shape == (32, 32)
    assert not torch.allclose(copy.layers[0].down_proj.weight, before)
    assert down_rotated(copy, 32) is copy   # already rotated: not again
    assert down_rotated(model, 32).layers[0].down_rotation.shape == (32, 32) and model.layers[0].down_rotation is None
    act = torch.randn(3, model.cfg.intermediate_size)
    for layer, rotated in zip(model.layers, copy.layers):
        assert torch.allclose(rotated.down_proj(rotated.down_input(act)), layer.down_proj(act), atol=1e-5)
    rotate_down_proj(model, 64)   # in place: the engine now serves the rotated float model, same tokens
    assert greedy_tokens(llm) == reference
    with pytest.raises(ValueError, match="layers.0.down_proj is already rotated"):
        rotate_down_proj(model)
    quantized = quantize_model(LLM("random:tiny-llama").engine.model, "int4", 32)
    with pytest.raises(ValueError, match="layers.0.down_proj is quantized"):
        rotate_down_proj(quantized)


def test_rotate_norm_outputs_keeps_the_float_model():
    """Each layer's two norms leave their output rotated; qkv_proj and gate_up_proj store W H: the
    same tokens, the norm weights and the residual stream untouched."""
    llm = LLM("random:tiny-llama", max_num_seqs=2)
    model = llm.engine.model
    reference = greedy_tokens(llm)
    layer = model.layers[0]
    norm_weight, qkv = layer.input_layernorm.weight.clone(), layer.qkv_proj.weight.clone()
    x = torch.randn(3, model.cfg.hidden_size)
    want = layer.qkv_proj(layer.input_layernorm(x)), layer.gate_up_proj(layer.post_attention_layernorm(x))
    assert norm_rotation_block(model, 128) == 64 and norm_rotation_block(model, 32) == 32
    rotate_norm_outputs(model, 32)
    assert layer.input_layernorm.rotation.shape == layer.post_attention_layernorm.rotation.shape == (32, 32)
    assert model.norm.rotation is None   # the final norm feeds the head, which is not rotated
    assert torch.equal(layer.input_layernorm.weight, norm_weight)
    assert not torch.allclose(layer.qkv_proj.weight, qkv)
    got = layer.qkv_proj(layer.input_layernorm(x)), layer.gate_up_proj(layer.post_attention_layernorm(x))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)
    normed = torch.nn.functional.rms_norm(x, (model.cfg.hidden_size,), norm_weight, model.cfg.rms_norm_eps)
    assert torch.allclose(layer.input_layernorm(x), rotate_blocks(normed, hadamard(32)), atol=1e-5)
    assert greedy_tokens(llm) == reference
    with pytest.raises(ValueError, match="layers.0.qkv_proj is already rotated"):
        rotate_norm_outputs(model)
    quantized = quantize_model(LLM("random:tiny-llama").engine.model, "int4", 32)
    with pytest.raises(ValueError, match="layers.0.qkv_proj is quantized"):
        rotate_norm_outputs(quantized)


def test_int4_rotated_rotates_both_once_and_leaves_the_donor_alone():
    model = LLM("random:tiny-llama").engine.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = int4_rotated(model, 32)
    assert copy is not model
    assert model.layers[0].down_rotation is None and model.layers[0].input_layernorm.rotation is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert copy.layers[1].down_rotation.shape == copy.layers[1].post_attention_layernorm.rotation.shape == (32, 32)
    assert int4_rotated(copy, 32) is copy   # already rotated: not again
    x = torch.randn(4, model.cfg.hidden_size)
    positions = torch.arange(4)
    meta = AttentionMetadata(query_lens=[4], num_cached=[0], slot_mapping=None, use_cache=False)
    for layer, rotated in zip(model.layers, copy.layers):   # a pass without a pool: torch attention
        assert torch.allclose(rotated(positions, x, meta), layer(positions, x, meta), atol=1e-4)
    half = rotate_down_proj(shallow_copy(model), 32)   # only down_proj rotated: int4_rotated adds the norms, in place
    assert int4_rotated(half, 32, in_place=True) is half and half.layers[0].input_layernorm.rotation.shape == (32, 32)
