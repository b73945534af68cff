"""Hadamard rotations of a model's quantized matrices' inputs, for int4 calibration. The rotation
itself is in quant/rotate.py; here it is applied to a model: down_proj's input (rotate_down_proj,
weight_calibration="autoround" and "gptq") and the norm outputs (rotate_norm_outputs, "gptq")."""

from __future__ import annotations

import torch
from torch import nn

from ...quant import QuantizedLinear
from ...quant.rotate import hadamard, rotate_blocks
from ..llama import LlamaForCausalLM
from .common import shallow_copy


@torch.no_grad()
def _rotate_weight(linear, h: torch.Tensor) -> None:
    """linear's weight W replaced by W @ blockdiag(h, ...) as a new tensor (a shallow copy's donor keeps its own)."""
    w = linear.weight
    linear.weight = nn.Parameter(rotate_blocks(w.float(), h).to(w.dtype), requires_grad=False)


@torch.no_grad()
def rotate_down_proj(model: LlamaForCausalLM, block: int = 128) -> LlamaForCausalLM:
    """Rotate every decoder layer's down_proj input within blocks of `block` channels (quant/rotate.py):
    down_proj's weight becomes W @ blockdiag(H) (a new tensor: a shallow copy's donor keeps its own)
    and the layer multiplies SiLU-and-mul's output by H (DecoderLayer.down_input). The float model
    computes the same function; int4 groups of `block` aligned to the blocks see smoother rows.
    In place on `model`'s module tree; returns it."""
    for i, layer in enumerate(model.layers):
        if layer.down_rotation is not None or isinstance(layer.down_proj, QuantizedLinear):
            raise ValueError(f"rotate_down_proj needs the float, unrotated model: layers.{i}.down_proj is "
                             f"{'already rotated' if layer.down_rotation is not None else 'quantized'}")
    w = model.layers[0].down_proj.weight
    h = hadamard(block, device=w.device)
    shared = h.to(w.dtype)   # one constant for every layer (a buffer, like the rotary tables: not weight bytes)
    for layer in model.layers:
        _rotate_weight(layer.down_proj, h)
        layer.down_rotation = shared
    return model


def rotation_block(model: LlamaForCausalLM, group_size: int) -> int:
    """The Hadamard block weight_calibration="autoround" rotates down_proj's input by: the int4 group
    size, halved until it divides the intermediate size (so every block lies inside one group)."""
    block = group_size
    while model.cfg.intermediate_size % block:
        block //= 2
    return block


NORM_ROTATION_BLOCK = 64   # Hadamard block for the norm outputs (rotate_norm_outputs)


@torch.no_grad()
def rotate_norm_outputs(model: LlamaForCausalLM, block: int = NORM_ROTATION_BLOCK) -> LlamaForCausalLM:
    """Rotate the output of every decoder layer's two RMSNorms within blocks of `block` channels:
    qkv_proj's and gate_up_proj's weights become W @ blockdiag(H) (new tensors, as in rotate_down_proj)
    and each norm multiplies its output by H (RMSNorm.rotation), b multiply-adds per channel.
    The residual stream itself is not rotated, and the norm's weight stays in the norm (folding it
    into W first, QuaRot's way, quantized worse: docs/notes/performance-history.md)."""
    for i, layer in enumerate(model.layers):
        for norm, name in [(layer.input_layernorm, "qkv_proj"), (layer.post_attention_layernorm, "gate_up_proj")]:
            if norm.rotation is not None or isinstance(getattr(layer, name), QuantizedLinear):
                raise ValueError(f"rotate_norm_outputs needs the float, unrotated model: layers.{i}.{name} is "
                                 f"{'already rotated' if norm.rotation is not None else 'quantized'}")
    w = model.layers[0].qkv_proj.weight
    h = hadamard(block, device=w.device)
    shared = h.to(w.dtype)
    for layer in model.layers:
        for norm, linear in [(layer.input_layernorm, layer.qkv_proj),
                             (layer.post_attention_layernorm, layer.gate_up_proj)]:
            _rotate_weight(linear, h)
            norm.rotation = shared
    return model


def norm_rotation_block(model: LlamaForCausalLM, group_size: int) -> int:
    """The Hadamard block weight_calibration="gptq" rotates the norm outputs by: NORM_ROTATION_BLOCK
    (or the group size if smaller), halved until it divides the hidden size."""
    block = min(NORM_ROTATION_BLOCK, group_size)
    while model.cfg.hidden_size % block:
        block //= 2
    return block


def down_rotated(model: LlamaForCausalLM, group_size: int, in_place: bool = False) -> LlamaForCausalLM:
    """The float model weight_calibration="autoround" calibrates and quantizes: down_proj's input
    rotated (rotate_down_proj). `model` itself if it already is; else `model` rotated (in_place) or
    a rotated shallow copy (the donor is left as it was)."""
    if model.layers[0].down_rotation is not None:
        return model
    return rotate_down_proj(model if in_place else shallow_copy(model), rotation_block(model, group_size))


def int4_rotated(model: LlamaForCausalLM, group_size: int, in_place: bool = False) -> LlamaForCausalLM:
    """The float model weight_calibration="gptq" calibrates and quantizes: down_proj's input
    (rotate_down_proj) and the norm outputs (rotate_norm_outputs) rotated. `model` itself if both
    already are; else `model` rotated (in_place) or a rotated shallow copy (the donor is left as it was).
    weight_calibration="autoround" rotates down_proj's input only (down_rotated): its layer-by-layer
    stage does worse with the norm outputs rotated too."""
    first = model.layers[0]
    if first.down_rotation is not None and first.input_layernorm.rotation is not None:
        return model
    model = down_rotated(model if in_place else shallow_copy(model), group_size, in_place=True)
    if model.layers[0].input_layernorm.rotation is None:
        rotate_norm_outputs(model, norm_rotation_block(model, group_size))
    return model

