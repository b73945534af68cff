"""The weight_dtype lever: swap a loaded model's matrices for quantized layers (minillm/quant).

Quantized: every Linear of the decoder layers (qkv_proj, o_proj, gate_up_proj, down_proj) in
weight_dtype, and the lm_head in its own head dtype (the weight_head_dtype lever, see
head_dtype_for): by default int8 per-channel under int4 weights, the weight_dtype itself under
int8 / fp8. Kept in the model dtype: the norms, the rotary tables and an untied embedding table
(a lookup reads one row per token, so its bytes do not bound decode). A tied embedding (SmolLM2)
is dropped: the model looks its rows up in the quantized head (QuantizedLinear.rows), so the
matrix is stored once.

Why the head is not 4-bit by default: it is the one matrix whose every output row is a logit, and
4-bit groups cost far more perplexity there than anywhere else. weight_head_dtype="int4" uses groups
of 32 (HEAD_INT4_GROUP_SIZE), and GPTQ under weight_calibration="gptq", "gptq-tuned" or "autoround";
it still costs more than the int8 head (docs/PERFORMANCE.md). AWQ and GPTQ (llm-awq, AutoAWQ,
AutoGPTQ) leave lm_head unquantized; int8 per-channel keeps it close to float while it still reads
half the bytes of bf16 per decode step.

The calibrations (weight_calibration) are in models/calibrate/, one module per method; the names
other code imports from here are re-exported below.
"""

from __future__ import annotations

import torch

from ..config import WEIGHT_HEAD_DTYPES as HEAD_DTYPES
from ..quant import QuantizedLinear
from .calibrate.autoround import AUTOROUND_BATCH_TOKENS, AUTOROUND_STEPS, calibrate_autoround  # noqa: F401
from .calibrate.awq import AWQ_SEARCH_TOKENS, awq_module, calibrate_awq, clip_weight  # noqa: F401
from .calibrate.cache import (CALIBRATION_TEXT, GENERATED_CALIBRATION_TEXT, autoround_cache_path,  # noqa: F401
                              autoround_calibration, autoround_is_cached, autoround_token_ids, cached_calibration,
                              calibration_cache_dir, calibration_cache_path, calibration_token_ids,
                              gptq_tuned_cache_path, gptq_tuned_calibration)
from .calibrate.common import (HEAD_INT4_GROUP_SIZE, LAYER_LINEARS, shallow_copy,  # noqa: F401
                               training_pass)
from .calibrate.gptq import GPTQ_OPTIONS, GPTQ_TOKENS, calibrate_gptq  # noqa: F401
from .calibrate.rotate import (down_rotated, int4_rotated, norm_rotation_block, rotate_down_proj,  # noqa: F401
                               rotate_norm_outputs, rotation_block)
from .calibrate.tune import E2E_BATCH_TOKENS, E2E_LR, E2E_STEPS, tune_int4_grids  # noqa: F401
from .llama import LlamaForCausalLM


def head_dtype_for(weight_dtype: str | None, weight_head_dtype: str = "auto") -> str | None:
    """The lm_head's storage under weight_dtype: None (the model dtype, not quantized) or a weight dtype.

    "auto": int8 per-channel under int4 weights (the head stays out of 4-bit, as AWQ / GPTQ
    practice keeps it; int8 rather than float so decode still reads half the bytes), else the
    weight_dtype itself (int8 -> int8, fp8 -> fp8, no weight_dtype -> model dtype).
    "model": keep the head in the model dtype. "int8" / "int4" / "fp8": that dtype
    (int4 in groups of HEAD_INT4_GROUP_SIZE = 32, whatever the body's group size).
    """
    if weight_head_dtype not in HEAD_DTYPES:
        raise ValueError(f"weight_head_dtype={weight_head_dtype!r} is not one of {HEAD_DTYPES}")
    if weight_dtype in (None, "auto") or weight_head_dtype == "model":
        return None
    if weight_head_dtype == "auto":
        return "int8" if weight_dtype == "int4" else weight_dtype
    return weight_head_dtype


@torch.no_grad()
def quantize_model(model: LlamaForCausalLM, weight_dtype: str, group_size: int = 128, fast: bool = True,
                   in_place: bool = True, input_scales: dict[str, torch.Tensor] | None = None,
                   head_dtype: str | None = "same", clips: dict[str, torch.Tensor] | None = None,
                   quantized: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                   head_group_size: int | None = None) -> LlamaForCausalLM:
    """Replace the decoder Linears by quantized layers of weight_dtype and the head by one of head_dtype
    (QuantizedLinear.from_float).

    in_place=False quantizes a shallow copy and leaves `model` (e.g. another engine's fp32
    weights, LLM.with_levers) as it was; the copy shares the embedding, norms and rotary tables.
    input_scales: {"layers.3.qkv_proj": s [in_features], ...} from calibrate_awq (activation-aware);
    clips: {"layers.3.qkv_proj": (low, high) of w * s per group [out_features, groups, 2]} from calibrate_awq.
    head_dtype: "same" (weight_dtype), None (keep the head in the model dtype) or a weight dtype
    (head_dtype_for turns the weight_head_dtype lever into this).
    quantized: {"layers.3.qkv_proj": (q, scale, zero)} int4 matrices already on the grid (calibrate_gptq),
    stored as given (of w * input_scale when input_scales has the key); "lm_head" for an int4 head.
    head_group_size: an int4 head's group size (None: group_size).
    """
    if not in_place:
        model = shallow_copy(model)
    input_scales, clips, quantized = input_scales or {}, clips or {}, quantized or {}
    for i, layer in enumerate(model.layers):
        if layer.moe is not None:   # experts, shared expert (models/moe.py); the attention's linears below
            layer.moe = layer.moe.quantized(weight_dtype, group_size, fast=fast)
        for name in LAYER_LINEARS if layer.moe is None else LAYER_LINEARS[:2]:
            linear, key = getattr(layer, name), f"layers.{i}.{name}"
            w = linear.weight.data
            if key in clips:
                w = clip_weight(w, input_scales.get(key), clips[key], group_size)
            setattr(layer, name, QuantizedLinear.from_float(w, None if linear.bias is None else linear.bias.data,
                                                 weight_dtype, group_size, fast=fast,
                                                 input_scale=input_scales.get(key), quantized=quantized.get(key)))
    if head_dtype == "same":
        head_dtype = weight_dtype
    if head_dtype is not None:
        model.quantized_head = QuantizedLinear.from_float(model.lm_head_weight, None, head_dtype, head_group_size or group_size,
                                               fast=fast, quantized=quantized.get("lm_head"))
        if model.lm_head is None:  # tied: the embedding is looked up in the quantized head (one copy)
            model.embed_tokens = None
        model.lm_head = None  # an untied float head is dropped; its separate embedding table stays
    return model


def quantize_for_config(model: LlamaForCausalLM, weight_dtype: str, group_size: int, calibration: str | None,
                        tokenizer, in_place: bool, head_dtype: str = "auto") -> LlamaForCausalLM:
    """What the engine does for weight_dtype / weight_group_size / weight_calibration (/ weight_head_dtype:
    head_dtype is that lever's value, resolved by head_dtype_for). EngineConfig has checked the
    combination (gptq and autoround need int4)."""
    scales = clips = parts = None
    if calibration is not None and model.cfg.num_experts:
        raise ValueError(f"weight_calibration={calibration!r} is not supported for mixture-of-experts models "
                         f"({model.cfg.model_type}); use weight_calibration=None (round to nearest, expert by expert)")
    if calibration == "awq":
        ids = calibration_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
        scales, clips = calibrate_awq(model, ids, weight_dtype, group_size)
    head = head_dtype_for(weight_dtype, head_dtype)
    head_group = HEAD_INT4_GROUP_SIZE if head == "int4" else None
    if calibration in ("gptq", "gptq-tuned", "autoround") and not in_place:   # the engine keeps the model it passed
        model, in_place = shallow_copy(model), True
    if calibration == "gptq":
        model = int4_rotated(model, group_size, in_place=True)
        ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)[:GPTQ_TOKENS]
        scales, parts = calibrate_gptq(model, ids, group_size, head_group_size=head_group, **GPTQ_OPTIONS)
    if calibration == "gptq-tuned":
        model = int4_rotated(model, group_size, in_place=True)
        scales, parts = gptq_tuned_calibration(model, tokenizer, group_size)
    if calibration == "autoround":
        model = down_rotated(model, group_size, in_place=True)
        scales, parts = autoround_calibration(model, tokenizer, group_size)
    if calibration in ("gptq-tuned", "autoround") and head != "int4":   # their entry serves both heads
        parts = {key: value for key, value in parts.items() if key != "lm_head"}
    return quantize_model(model, weight_dtype, group_size, in_place=in_place, input_scales=scales, clips=clips,
                          quantized=parts, head_dtype=head, head_group_size=head_group)
