"""The weight_dtype lever: swap a loaded model's matrices for QuantizedLinear (minillm/quant).

Quantized: every Linear of the decoder layers (qkv_proj, o_proj, gate_up_proj, down_proj) and
the lm_head. Kept in the model dtype: the embedding table (a lookup reads one row per token, so
its bytes do not bound decode), the norms and the rotary tables. For a tied head (SmolLM2) the
head gets its own quantized copy of the embedding matrix, so the float embedding stays too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..layers.attention import AttentionMetadata, TorchAttentionBackend
from ..quant import QuantizedLinear
from ..quant.awq import search_input_scale
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
                   in_place: bool = True, input_scales: dict[str, torch.Tensor] | None = None) -> LlamaForCausalLM:
    """Replace the decoder Linears and the head by QuantizedLinear(weight_dtype).

    in_place=False quantizes a shallow copy and leaves `model` (e.g. another engine's fp32
    weights, LLM.with_levers) as it was; the copy shares the embedding, norms and rotary tables.
    input_scales: {"layers.3.qkv_proj": s [in_features], ...} from calibrate_awq (activation-aware).
    """
    if not in_place:
        model = shallow_copy(model)
    input_scales = input_scales or {}
    for i, layer in enumerate(model.layers):
        for name in LAYER_LINEARS:
            linear = getattr(layer, name)
            setattr(layer, name, QuantizedLinear(linear.weight.data, None if linear.bias is None else linear.bias.data,
                                                 weight_dtype, group_size, fast=fast,
                                                 input_scale=input_scales.get(f"layers.{i}.{name}")))
    head = model.lm_head_weight
    model.quantized_head = QuantizedLinear(head, None, weight_dtype, group_size, fast=fast)
    model.lm_head = None  # an untied float head is dropped; a tied one is the embedding, which stays
    return model


def set_quantized_matmul(model: LlamaForCausalLM, fn, weight_dtype: str = "int4") -> int:
    """Plug y = fn(x2d, layer) into every QuantizedLinear of `weight_dtype` (the quantized head
    included; see QuantizedLinear.set_matmul); fn=None restores their own paths. Returns the
    number of layers hooked (0: the model has no such layer). A lab's kernel reads the layer's
    plain layout: layer.int4_parts() / layer.int8_parts()."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.weight_dtype == weight_dtype:
            module.set_matmul(fn)
            count += 1
    return count


@torch.no_grad()
def calibrate_awq(model: LlamaForCausalLM, token_ids: list[int], weight_dtype: str = "int4", group_size: int = 128,
                  grid: int = 10) -> dict[str, torch.Tensor]:
    """AWQ-style input scales for every decoder Linear (the head stays round-to-nearest).

    Runs the float model once on `token_ids` (one sequence, no KV cache, torch attention), records
    each Linear's input, and searches each matrix's scale (quant/awq.py). Returns
    {"layers.<i>.<name>": input_scale}, the argument quantize_model(input_scales=...) takes.
    Calibration text for the course: minillm/data/corpus.txt (a few hundred tokens suffice).
    """
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        for name in LAYER_LINEARS:
            module = getattr(layer, name)
            if isinstance(module, QuantizedLinear):
                raise ValueError(f"calibrate_awq needs the float model: layers.{i}.{name} is already quantized")
            key = f"layers.{i}.{name}"
            hooks.append(module.register_forward_hook(
                lambda mod, args, out, key=key: inputs.__setitem__(key, args[0].detach().float())))
    attention = model.attention_layers()
    saved = [(layer.backend, layer.k_cache, layer.v_cache) for layer in attention]
    saved_triton = model.use_triton_ops
    try:
        model.use_triton_ops = False
        for layer in attention:
            layer.backend = TorchAttentionBackend()
        device = model.embed_tokens.weight.device
        n = len(token_ids)
        meta = AttentionMetadata(query_lens=[n], num_cached=[0], slot_mapping=None, use_cache=False)
        model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), meta)
    finally:
        for hook in hooks:
            hook.remove()
        model.use_triton_ops = saved_triton
        for layer, (backend, k, v) in zip(attention, saved):
            layer.backend, layer.k_cache, layer.v_cache = backend, k, v
    scales = {}
    for i, layer in enumerate(model.layers):
        for name in LAYER_LINEARS:
            key = f"layers.{i}.{name}"
            scales[key], _, _ = search_input_scale(getattr(layer, name).weight.data, inputs[key],
                                                   weight_dtype, group_size, grid)
    return scales


CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"


def calibration_token_ids(tokenizer, num_tokens: int = 256, vocab_size: int | None = None) -> list[int]:
    """The first `num_tokens` tokens of minillm/data/corpus.txt (fixed pseudo-random ids for
    random-weight presets, which have no tokenizer)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size or 2, (num_tokens,), generator=g).tolist()
    return tokenizer.encode(CALIBRATION_TEXT.read_text())[:num_tokens]


def quantize_for_config(model: LlamaForCausalLM, weight_dtype: str, group_size: int, calibration: str | None,
                        tokenizer, in_place: bool) -> LlamaForCausalLM:
    """What the engine does for weight_dtype / weight_group_size / weight_calibration."""
    scales = None
    if calibration == "awq":
        ids = calibration_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
        scales = calibrate_awq(model, ids, weight_dtype, group_size)
    return quantize_model(model, weight_dtype, group_size, in_place=in_place, input_scales=scales)
