"""The weight_dtype lever: swap a loaded model's matrices for QuantizedLinear (minillm/quant).

Quantized: every Linear of the decoder layers (qkv_proj, o_proj, gate_up_proj, down_proj) and
the lm_head. Kept in the model dtype: the embedding table (a lookup reads one row per token, so
its bytes do not bound decode), the norms and the rotary tables. For a tied head (SmolLM2) the
head gets its own quantized copy of the embedding matrix, so the float embedding stays too.
"""

from __future__ import annotations

import copy

import torch

from ..quant import QuantizedLinear
from .llama import LlamaForCausalLM

LAYER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def shallow_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A new module tree that shares every tensor of `model` (weights, buffers, a bound KV pool):
    replacing one of its submodules leaves `model` untouched."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for value in list(module.__dict__.values()) + list(module._parameters.values()) + list(module._buffers.values()):
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
    runner = getattr(model, "bound_runner", None)
    if runner is not None:
        memo[id(runner)] = None
    clone = copy.deepcopy(model, memo)
    clone.bound_runner = None
    return clone


@torch.no_grad()
def quantize_model(model: LlamaForCausalLM, weight_dtype: str, group_size: int = 128, fast: bool = True,
                   in_place: bool = True) -> LlamaForCausalLM:
    """Replace the decoder Linears and the head by QuantizedLinear(weight_dtype).

    in_place=False quantizes a shallow copy and leaves `model` (e.g. another engine's fp32
    weights, LLM.with_levers) as it was; the copy shares the embedding, norms and rotary tables.
    """
    if not in_place:
        model = shallow_copy(model)
    for layer in model.layers:
        for name in LAYER_LINEARS:
            linear = getattr(layer, name)
            setattr(layer, name, QuantizedLinear(linear.weight.data, None if linear.bias is None else linear.bias.data,
                                                 weight_dtype, group_size, fast=fast))
    head = model.lm_head_weight
    model.quantized_head = QuantizedLinear(head, None, weight_dtype, group_size, fast=fast)
    model.lm_head = None  # an untied float head is dropped; a tied one is the embedding, which stays
    return model
