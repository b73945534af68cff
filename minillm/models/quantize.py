"""The weight_dtype lever: swap a loaded model's matrices for QuantizedLinear (minillm/quant).

Quantized: every Linear of the decoder layers (qkv_proj, o_proj, gate_up_proj, down_proj) in
weight_dtype, and the lm_head in its own head dtype (the weight_head_dtype lever, see
head_dtype_for): by default int8 per-channel under int4 weights, the weight_dtype itself under
int8 / fp8. Kept in the model dtype: the norms, the rotary tables and an untied embedding table
(a lookup reads one row per token, so its bytes do not bound decode). A tied embedding (SmolLM2)
is dropped: the model looks its rows up in the quantized head (QuantizedLinear.rows), so the
matrix is stored once.

Why the head is not 4-bit by default: it is the one matrix whose every output row is a logit,
and 4-bit groups of 128 along its 576 inputs cost SmolLM2-135M about +60% perplexity on their own.
weight_head_dtype="int4" uses groups of 32 (HEAD_INT4_GROUP_SIZE), and GPTQ under
weight_calibration="gptq", "gptq-tuned" or "autoround": +13.1% against +10.2% with the int8 head
under gptq, +10.8% against +7.7% under gptq-tuned, +11.1% against +8.9% under autoround
(docs/PERFORMANCE.md).
AWQ and GPTQ (llm-awq, AutoAWQ, AutoGPTQ) leave lm_head unquantized; int8 per-channel keeps it
within a fraction of a percent while it still reads half the bytes of bf16 per decode step.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import WEIGHT_HEAD_DTYPES as HEAD_DTYPES
from ..layers.attention import AttentionMetadata, TorchAttentionBackend
from ..quant import QuantizedLinear
from ..quant.awq import search_clip, search_input_scale
from ..quant.gptq import gptq_int4, input_hessian
from ..quant.int4 import dequantize_int4
from .llama import LlamaForCausalLM

LAYER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# An int4 head (weight_head_dtype="int4") uses groups of 32 whatever the body's group size: it is the
# most sensitive matrix (every output is a logit), and with a tied embedding it is the embedding too.
HEAD_INT4_GROUP_SIZE = 32


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
def _rotate_weight(linear, h: torch.Tensor) -> None:
    """linear's weight W replaced by W @ blockdiag(h, ...) as a new tensor (a shallow copy's donor keeps its own)."""
    from torch import nn

    from ..quant.rotate import rotate_blocks

    w = linear.weight
    linear.weight = nn.Parameter(rotate_blocks(w.float(), h).to(w.dtype), requires_grad=False)


@torch.no_grad()
def rotate_down_proj(model: LlamaForCausalLM, block: int = 128) -> LlamaForCausalLM:
    """Rotate every decoder layer's down_proj input within blocks of `block` channels (quant/rotate.py):
    down_proj's weight becomes W @ blockdiag(H) (a new tensor: a shallow copy's donor keeps its own)
    and the layer multiplies SiLU-and-mul's output by H (DecoderLayer.down_input). The float model
    computes the same function; int4 groups of `block` aligned to the blocks see smoother rows.
    In place on `model`'s module tree; returns it."""
    from ..quant.rotate import hadamard

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


NORM_ROTATION_BLOCK = 64   # Hadamard block for the norm outputs (rotate_norm_outputs): measured, see its docstring


@torch.no_grad()
def rotate_norm_outputs(model: LlamaForCausalLM, block: int = NORM_ROTATION_BLOCK) -> LlamaForCausalLM:
    """Rotate the output of every decoder layer's two RMSNorms within blocks of `block` channels:
    qkv_proj's and gate_up_proj's weights become W @ blockdiag(H) (new tensors, as in rotate_down_proj)
    and each norm multiplies its output by H (RMSNorm.rotation), b multiply-adds per channel.
    The residual stream itself is not rotated, and the norm's weight stays in the norm.

    Measured on SmolLM2-135M, int4 g128 with down_proj's input already rotated (simulated in fp32, full
    corpus): GPTQ +12.46% -> +9.85%, round to nearest +78.82% -> +58.75% with 64-channel blocks, and
    +69.83% with 128-channel blocks. Folding the norm's weight into W first (QuaRot's way) made
    round to nearest far worse (+131.82%), as rotating the whole residual stream did."""
    from ..quant.rotate import hadamard

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
    (AutoRound's layer-by-layer stage lost with the norm outputs rotated too, +11.74% against +9.38%
    simulated, so weight_calibration="autoround" rotates down_proj's input only: down_rotated.)"""
    first = model.layers[0]
    if first.down_rotation is not None and first.input_layernorm.rotation is not None:
        return model
    model = down_rotated(model if in_place else shallow_copy(model), group_size, in_place=True)
    if model.layers[0].input_layernorm.rotation is None:
        rotate_norm_outputs(model, norm_rotation_block(model, group_size))
    return model


@torch.no_grad()
def clip_weight(w: torch.Tensor, input_scale: torch.Tensor | None, clip: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] with each group of (w * input_scale) clamped to [low, high] (clip [N, groups, 2],
    from calibrate_awq / search_clip), returned unscaled: QuantizedLinear multiplies input_scale back in."""
    n, k = w.shape
    s = torch.ones(k, device=w.device) if input_scale is None else input_scale.float().to(w.device)
    ws = w.float() * s
    pad = (-k) % group_size
    if pad:
        ws = torch.nn.functional.pad(ws, (0, pad))
    g = ws.reshape(n, -1, group_size)
    bounds = clip.float().to(w.device)
    g = torch.maximum(torch.minimum(g, bounds[..., 1:]), bounds[..., :1])
    return (g.reshape(n, -1)[:, :k] / s).to(w.dtype)


@torch.no_grad()
def quantize_model(model: LlamaForCausalLM, weight_dtype: str, group_size: int = 128, fast: bool = True,
                   in_place: bool = True, input_scales: dict[str, torch.Tensor] | None = None,
                   head_dtype: str | None = "same", clips: dict[str, torch.Tensor] | None = None,
                   quantized: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                   head_group_size: int | None = None) -> LlamaForCausalLM:
    """Replace the decoder Linears by QuantizedLinear.from_float(weight_dtype) and the head by QuantizedLinear.from_float(head_dtype).

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
        for name in LAYER_LINEARS:
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


@contextmanager
def torch_attention(model: LlamaForCausalLM):
    """Run the model's attention through the torch backend without a KV cache (calibration passes
    over whole sequences), and give each layer back its backend, cache and Triton ops afterwards."""
    attention = model.attention_layers()
    saved = [(layer.backend, layer.k_cache, layer.v_cache) for layer in attention]
    saved_triton = model.use_triton_ops
    try:
        model.use_triton_ops = False
        for layer in attention:
            layer.backend = TorchAttentionBackend()
        yield
    finally:
        model.use_triton_ops = saved_triton
        for layer, (backend, k, v) in zip(attention, saved):
            layer.backend, layer.k_cache, layer.v_cache = backend, k, v


@contextmanager
def training_pass(model: LlamaForCausalLM):
    """torch_attention with autograd on (also inside inference mode) and the model's own parameters
    frozen: calibrations that train their own tensors through the model's forward. Each
    parameter's requires_grad is given back afterwards."""
    params = list(model.parameters())
    trainable = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        with torch_attention(model), torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for p, flag in zip(params, trainable):
            p.requires_grad_(flag)


def calibration_sequences(who: str, token_ids: list[int], steps: int, batch_tokens: int, seq_len: int
                          ) -> tuple[int, int, int]:
    """A training calibration's batching, its arguments checked (`who` names it in the errors):
    (seq_len, at most the number of tokens; num_seqs, whole sequences of it in token_ids;
    per_step, sequences in a batch of about batch_tokens, at least 1 and at most num_seqs)."""
    if steps < 1 or batch_tokens < 1 or seq_len < 1:
        raise ValueError(f"steps={steps}, batch_tokens={batch_tokens} and seq_len={seq_len} must each be >= 1")
    if len(token_ids) < 2:
        raise ValueError(f"{who} needs at least 2 calibration tokens, got {len(token_ids)}")
    seq_len = min(seq_len, len(token_ids))
    num_seqs = len(token_ids) // seq_len
    return seq_len, num_seqs, max(1, min(num_seqs, batch_tokens // seq_len))


def sequence_layout(seq_len: int, n: int, device) -> tuple[torch.Tensor, AttentionMetadata]:
    """positions and kv_cache-free metadata for n sequences of seq_len tokens run together."""
    return (torch.arange(seq_len, device=device).repeat(n),
            AttentionMetadata(query_lens=[seq_len] * n, num_cached=[0] * n, slot_mapping=None, use_cache=False))


def awq_module(layer, name: str, positions: torch.Tensor, meta: AttentionMetadata):
    """What a matrix's input-scale search scores (search_input_scale's module=), as llm-awq does:
    qkv_proj -> (x, W) -> attention and o_proj; gate_up_proj -> (x, W) -> SiLU-and-mul and down_proj
    (the rest of the block in float, on the calibration sequence's positions); o_proj and down_proj
    feed the residual stream directly: None (their own output)."""
    from ..layers.activation import silu_and_mul

    def project(x, w, linear):
        y = x @ w.t()
        return y if linear.bias is None else y + linear.bias.float()

    cfg = layer.cfg
    if name == "qkv_proj":
        wo = layer.o_proj.weight.float()

        def attention(x, w):
            q, k, v = project(x, w, layer.qkv_proj).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            t = x.shape[0]
            q, k = layer.rotary(positions, q.reshape(t, cfg.num_heads, cfg.head_dim),
                                k.reshape(t, cfg.num_kv_heads, cfg.head_dim))
            return layer.attn(q, k, v.reshape(t, cfg.num_kv_heads, cfg.head_dim), meta).reshape(t, layer.q_size) @ wo.t()
        return attention
    if name == "gate_up_proj":
        wd = layer.down_proj.weight.float()
        return lambda x, w: layer.down_input(silu_and_mul(project(x, w, layer.gate_up_proj))) @ wd.t()
    return None


@torch.no_grad()
def calibrate_awq(model: LlamaForCausalLM, token_ids: list[int], weight_dtype: str = "int4", group_size: int = 128,
                  grid: int = 20, clip: bool = True, two_sided: bool = True, objective: str = "module",
                  progress: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """AWQ-style input scales (and, for int4, clipping ranges) for every decoder Linear.

    Runs the float model once on `token_ids` (one sequence, no KV cache, torch attention), records
    each Linear's input, searches each matrix's input scale (quant/awq.py search_input_scale), then
    with clip=True and int4 each group's clipping range on the scaled matrix (search_clip).
    objective="module" scores QKV's scale on the attention block's output and gate/up's on the
    MLP's (awq_module, llm-awq's choice); "linear" scores every matrix on its own output. On the
    default model at int4 group 128 the block objective cut the perplexity increase on the whole
    corpus from +16.9% to +15.6% (docs/PERFORMANCE.md).
    two_sided: search the low and high ends of each group apart (asymmetric int4), else AWQ's [-m, m].
    Returns ({"layers.<i>.<name>": input_scale}, {"layers.<i>.<name>": clip [N, groups, 2]}), the
    input_scales= and clips= arguments of quantize_model. The head is not calibrated (see
    head_dtype_for). Calibration text for the course: minillm/data/calibration.txt.
    """
    from tqdm.auto import tqdm

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
    if objective not in ("module", "linear"):
        raise ValueError(f"objective={objective!r} must be 'module' or 'linear'")
    device = model.embed_tokens.weight.device
    n = len(token_ids)
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata(query_lens=[n], num_cached=[0], slot_mapping=None, use_cache=False)
    scales, clips = {}, {}
    with torch_attention(model):
        try:
            model(torch.tensor(token_ids, device=device), positions, meta)
        finally:
            for hook in hooks:
                hook.remove()
        keys = [(i, name) for i in range(len(model.layers)) for name in LAYER_LINEARS]
        for i, name in tqdm(keys, desc=f"AWQ calibration ({weight_dtype})", unit="matrix", disable=not progress,
                            leave=False):
            key, layer = f"layers.{i}.{name}", model.layers[i]
            w = getattr(layer, name).weight.data
            module = awq_module(layer, name, positions, meta) if objective == "module" else None
            scales[key], _, _ = search_input_scale(w, inputs[key], weight_dtype, group_size, grid, module=module)
            if clip and weight_dtype == "int4":
                clips[key], _ = search_clip(w, inputs[key], group_size, scales[key], grid, two_sided=two_sided)
            del inputs[key]
    return scales, clips


GPTQ_TOKENS = 4096  # calibration tokens for weight_calibration="gptq": the first of autoround_token_ids
GPTQ_OPTIONS = dict(act_order="static", clip=True)  # its calibrate_gptq options (also gptq-tuned's first stage)
AWQ_SEARCH_TOKENS = 512  # calibrate_gptq(awq=True): tokens the input-scale search scores


@torch.no_grad()
def calibrate_gptq(model: LlamaForCausalLM, token_ids: list[int], group_size: int = 128, awq: bool = True,
                   act_order: bool | str = False, damp: float = 0.01, seq_len: int = 512, grid: int = 20,
                   head_group_size: int | None = None, clip: bool = False, embed=None, progress: bool = True
                   ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """GPTQ int4 for every decoder Linear, layer by layer on the already quantized layers' activations.

    token_ids are cut into sequences of seq_len (run together, no KV cache, torch attention). For
    each layer in order, each of its four matrices in order (qkv, o, gate_up, down) sees the input
    the model produces when every matrix before it (earlier layers, and earlier matrices of this
    layer) is already int4: GPTQ then corrects the errors upstream of it too ("sequential").
    awq=True first searches the matrix's AWQ input scale on those inputs (quant/awq.py), then runs
    GPTQ on W * s with the Hessian of x / s. Returns ({"layers.<i>.<name>": input_scale} (awq only),
    {"layers.<i>.<name>": (q, scale, zero)}), the input_scales= and quantized= arguments of
    quantize_model. The model itself is left as it was (the quantized layers are temporary).
    embed: ids -> hidden for the first layer (default: the embedding table), e.g. the rows of an
    already quantized tied head, which will serve the lookup.
    clip: each group's range from AWQ's two-sided clipping search (search_clip) instead of its min / max.
    head_group_size: also GPTQ the lm_head to int4 with that group size (no input scale: a tied
    embedding is looked up in its rows), on the final norm's output; its key is "lm_head".
    """
    from tqdm.auto import tqdm

    from ..layers.activation import silu_and_mul

    for i, layer in enumerate(model.layers):
        for name in LAYER_LINEARS:
            if isinstance(getattr(layer, name), QuantizedLinear):
                raise ValueError(f"calibrate_gptq needs the float model: layers.{i}.{name} is already quantized")
    if not token_ids:
        raise ValueError("calibrate_gptq needs calibration tokens, got none")
    device = model.embed_tokens.weight.device
    chunks = [token_ids[j:j + seq_len] for j in range(0, len(token_ids), seq_len)]
    ids = torch.tensor(token_ids, device=device)
    positions = torch.cat([torch.arange(len(c), device=device) for c in chunks])
    meta = AttentionMetadata(query_lens=[len(c) for c in chunks], num_cached=[0] * len(chunks),
                             slot_mapping=None, use_cache=False)
    scales: dict[str, torch.Tensor] = {}
    parts: dict[str, tuple] = {}

    def quantize(layer, i: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """GPTQ one matrix on its inputs x; returns its (int4) output on x."""
        key, linear = f"layers.{i}.{name}", getattr(layer, name)
        w = linear.weight.data.float()
        s = None
        if awq:  # the scale search on at most AWQ_SEARCH_TOKENS evenly spaced tokens (its cost grows with them)
            pick = torch.linspace(0, x.shape[0] - 1, min(x.shape[0], AWQ_SEARCH_TOKENS)).long().to(x.device)
            s, _, _ = search_input_scale(w, x[pick], "int4", group_size, grid)
            scales[key] = s
        xs = x.float() if s is None else x.float() / s
        bounds = search_clip(w, x, group_size, s, grid, two_sided=True)[0] if clip else None
        q, scale, zero = gptq_int4(w if s is None else w * s, input_hessian(xs), group_size, damp, act_order,
                                   clip=bounds)
        parts[key] = (q, scale, zero)
        wq = dequantize_int4(q, scale, zero)[:, :w.shape[1]].to(device)
        y = xs.to(device) @ wq.t()
        if linear.bias is not None:
            y = y + linear.bias.float()
        return y.to(x.dtype)

    with torch_attention(model):
        hidden = (embed or model.embed_tokens)(ids)
        for i, layer in enumerate(tqdm(model.layers, desc="GPTQ calibration (int4)", unit="layer",
                                       disable=not progress, leave=False)):
            cfg = layer.cfg
            x = layer.input_layernorm(hidden)
            qkv = quantize(layer, i, "qkv_proj", x)
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            t = x.shape[0]
            q, k = layer.rotary(positions, q.reshape(t, cfg.num_heads, cfg.head_dim),
                                k.reshape(t, cfg.num_kv_heads, cfg.head_dim))
            attn = layer.attn(q, k, v.reshape(t, cfg.num_kv_heads, cfg.head_dim), meta).reshape(t, layer.q_size)
            hidden = hidden + quantize(layer, i, "o_proj", attn)
            x = layer.post_attention_layernorm(hidden)
            act = layer.down_input(silu_and_mul(quantize(layer, i, "gate_up_proj", x)))
            hidden = hidden + quantize(layer, i, "down_proj", act)
        if head_group_size is not None:
            x = model.norm(hidden).float()
            parts["lm_head"] = gptq_int4(model.lm_head_weight.float(), input_hessian(x), head_group_size, damp,
                                         act_order)
    return scales, parts


AUTOROUND_STEPS = 100         # signed-gradient steps per decoder layer
AUTOROUND_BATCH_TOKENS = 1024  # calibration tokens per step (whole sequences of seq_len)


def calibrate_autoround(model: LlamaForCausalLM, token_ids: list[int], group_size: int = 128,
                        steps: int = AUTOROUND_STEPS, batch_tokens: int = AUTOROUND_BATCH_TOKENS, seq_len: int = 512,
                        lr: float | None = None, awq_tokens: int = AWQ_SEARCH_TOKENS, seed: int = 0,
                        head_group_size: int | None = None, relative: bool = True, progress: bool = True
                        ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """Learned int4 rounding (quant/autoround.py, SignRound), layer by layer, on top of AWQ.

    1. AWQ's input scales and clipping ranges (calibrate_awq on the first `awq_tokens` tokens) are
       each matrix's starting point.
    2. token_ids are cut into sequences of seq_len. For each decoder layer in order, its four
       matrices get learnable rounding offsets and group ranges (LearnableInt4), trained together
       for `steps` signed-gradient steps (lr decaying linearly from lr, default 1 / steps) on
       random batches of about `batch_tokens` tokens, so that the int4 layer's output matches
       the float layer's output on the float model's activations. The int4 layer's input is the
       output of the int4 layers before it ("sequential"), so each layer also learns to absorb
       the error upstream of it. A layer whose error on all the calibration tokens (with its
       weights as they will be stored) ends higher than at the start keeps AWQ's rounding.
    3. head_group_size: also GPTQ the lm_head to int4 with that group size (as calibrate_gptq does),
       on the final norm of the int4 layers' output over all the calibration tokens; key "lm_head".
    relative: a token whose float output's mean square is above the median token's has its squared
    error divided by that excess (the scale the next RMSNorm divides out); the others keep the
    plain error (False: the plain mean squared error for all). SmolLM2's first token of a sequence
    (the attention sink) carries a residual stream ~150x larger than the others from layer 11 to 27
    (scripts/residual_norms.py); in a plain mean squared error the 2 such tokens of a 1,024-token
    step would make up 75-98% of the loss, and the others teach little. docs/PERFORMANCE.md:
    +10.99% against +11.64% plain, and +11.29% with every token divided by its own mean square.
    Returns ({"layers.<i>.<name>": input_scale}, {"layers.<i>.<name>": (q, scale, zero)}), the
    input_scales= and quantized= arguments of quantize_model; the model is left as it was.
    """
    from torch.func import functional_call
    from tqdm.auto import tqdm

    from ..quant.autoround import LearnableInt4

    seq_len, num_seqs, per_step = calibration_sequences("calibrate_autoround", token_ids, steps, batch_tokens, seq_len)
    scales, clips = calibrate_awq(model, token_ids[:awq_tokens], "int4", group_size, progress=False)
    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids[:num_seqs * seq_len], device=device)
    positions, meta = sequence_layout(seq_len, num_seqs, device)
    step_positions, step_meta = sequence_layout(seq_len, per_step, device)
    lr = 1.0 / steps if lr is None else lr
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, tuple] = {}
    with training_pass(model):
        with torch.no_grad():
            fp_in = model.embed_tokens(ids)
        q_in = fp_in
        for i, layer in enumerate(tqdm(model.layers, desc=f"AutoRound calibration (int4 g{group_size})",
                                       unit="layer", disable=not progress, leave=False)):
            dtype = layer.qkv_proj.weight.dtype
            learners = {name: LearnableInt4(getattr(layer, name).weight.data, group_size,
                                            scales[f"layers.{i}.{name}"], clips.get(f"layers.{i}.{name}"))
                        for name in LAYER_LINEARS}
            with torch.no_grad():
                fp_out = layer(positions, fp_in, meta)
                ms = fp_out.float().pow(2).mean(-1, keepdim=True).clamp_min(1e-12)   # each token's mean square [T, 1]
                weight = ms.median() / ms.clamp_min(ms.median()) if relative else torch.ones_like(ms)

            def run(x, pos, m, weights):
                return functional_call(layer, {f"{name}.weight": w.to(dtype) for name, w in weights.items()}, (pos, x, m))

            def stored_output():  # on every calibration token, with the weights as they will be stored
                with torch.no_grad():
                    return run(q_in, positions, meta, {n: lrn.stored_weight() for n, lrn in learners.items()})

            def error(out, rows=slice(None)):
                return ((out.float() - fp_out[rows].float()).pow(2) * weight[rows]).mean()

            start = {name: learner.state() for name, learner in learners.items()}
            start_error = float(error(stored_output()))
            for step in range(steps):
                pick = torch.randperm(num_seqs, generator=gen)[:per_step]
                rows = (pick[:, None] * seq_len + torch.arange(seq_len)).reshape(-1).to(device)
                out = run(q_in[rows], step_positions, step_meta, {n: lrn.weight() for n, lrn in learners.items()})
                error(out, rows).backward()
                for learner in learners.values():
                    learner.sign_step(lr * (1 - step / steps))
            out = stored_output()
            if float(error(out)) > start_error:  # never worse than AWQ's starting point on the calibration text
                for name, learner in learners.items():
                    learner.load_state(start[name])
                out = stored_output()
            for name, learner in learners.items():
                parts[f"layers.{i}.{name}"] = learner.export()
            q_in = out
            fp_in = fp_out
        if head_group_size is not None:
            with torch.no_grad():
                x = model.norm(q_in).float()
            parts["lm_head"] = gptq_int4(model.lm_head_weight.float(), input_hessian(x), head_group_size,
                                         act_order="static")
    return scales, parts


E2E_STEPS = 80            # Adam steps of tune_int4_grids on top of AutoRound
E2E_LR = 5e-4             # peak learning rate (cosine to 0) for the relative changes of scale and zero
E2E_BATCH_TOKENS = 2048   # calibration tokens per step (whole sequences of seq_len)


def _bf16_ste(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (as QuantizedLinear stores scale and zero) forward, identity backward."""
    return x + (x.to(torch.bfloat16).float() - x).detach()


def tune_int4_grids(model: LlamaForCausalLM, token_ids: list[int], input_scales: dict[str, torch.Tensor],
                    parts: dict[str, tuple], steps: int = E2E_STEPS, lr: float = E2E_LR,
                    batch_tokens: int = E2E_BATCH_TOKENS, seq_len: int = 512, seed: int = 1,
                    tune_input_scales: bool = False, head_dtype: str | None = None, progress: bool = True
                    ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """End-to-end tuning of every decoder int4 matrix's group scales and zeros, levels fixed
    (EfficientQAT's E2E-QP, Chen et al. 2024), on top of a layer-by-layer calibration's parts.

    calibrate_autoround fits each layer's output to the float layer's, one layer at a time. Here
    the whole int4 model is trained at once against what it is for, the float model's next-token
    distribution: the loss is KL(float || int4) over the vocabulary, averaged over random batches
    of about `batch_tokens` calibration tokens (whole sequences of seq_len), for `steps` Adam steps
    with a cosine learning rate from `lr`. Each group's scale and zero become
    scale * (1 + a) and zero + b * scale with a, b learned (from 0); the int4 levels q stay as the
    calibration chose them. The forward pass uses scale and zero rounded to bfloat16 as
    QuantizedLinear stores them (straight-through), so what is trained is what is served.
    tune_input_scales: each matrix's AWQ input scale s (the ones input_scales has) is learned too,
    as s * (1 + c) with c per input channel from 0: a column-wise gain on the int4 matrix that the
    levels, fixed per group of rows, cannot express (for qkv_proj and gate_up_proj it plays the part
    of the RMSNorm weight before them).
    head_dtype: the head the student uses, as it will be served ("int8": per-channel int8 of the
    float head, also its embedding table when tied; None: the float head). The teacher keeps the
    float head. Any "lm_head" part is left alone.
    Returns (input_scales, parts) with the tuned scales and the decoder matrices' (q, scale, zero)
    replaced; the model is left as it was.
    """
    import math

    import torch.nn.functional as F
    from torch.func import functional_call
    from tqdm.auto import tqdm

    if head_dtype not in (None, "int8"):
        raise ValueError(f"tune_int4_grids(head_dtype={head_dtype!r}): the student's head is None (float) or 'int8'")
    seq_len, num_seqs, per_step = calibration_sequences("tune_int4_grids", token_ids, steps, batch_tokens, seq_len)
    keys = [f"layers.{i}.{name}" for i in range(len(model.layers)) for name in LAYER_LINEARS]
    missing = [key for key in keys if key not in parts]
    if missing:
        raise ValueError(f"tune_int4_grids needs int4 parts for every decoder matrix; missing {missing[:3]}")
    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids[:num_seqs * seq_len], device=device).reshape(num_seqs, seq_len)
    positions, meta = sequence_layout(seq_len, per_step, device)
    in_features = {key: model.get_submodule(key).weight.shape[1] for key in keys}
    dtype = model.layers[0].qkv_proj.weight.dtype
    in_scale = {key: input_scales[key].to(device).float() for key in keys if key in input_scales}
    q = {key: parts[key][0].to(device).float() for key in keys}
    scale0 = {key: parts[key][1].to(device).float() for key in keys}
    zero0 = {key: parts[key][2].to(device).float() for key in keys}
    a = {key: torch.zeros_like(scale0[key], requires_grad=True) for key in keys}
    b = {key: torch.zeros_like(scale0[key], requires_grad=True) for key in keys}
    c = {key: torch.zeros_like(s, requires_grad=True) for key, s in in_scale.items()} if tune_input_scales else {}

    def grid(key):   # this matrix's (scale, zero) as they will be stored
        return _bf16_ste(scale0[key] * (1 + a[key])), _bf16_ste(zero0[key] + b[key] * scale0[key])

    def input_scale(key):
        return in_scale[key] * (1 + c[key]) if key in c else in_scale[key]

    head = model.lm_head_weight.detach()
    student_head = head if head_dtype is None else QuantizedLinear.from_float(head, None, "int8").dequantized_weight(head.dtype)
    tied = model.lm_head is None

    def weights():
        out = {"embed_tokens.weight": student_head} if tied and head_dtype is not None else {}
        for key in keys:
            scale, zero = grid(key)
            w = dequantize_int4(q[key], scale, zero)[:, :in_features[key]]
            out[f"{key}.weight"] = (w / input_scale(key) if key in in_scale else w).to(dtype)
        return out

    optimizer = torch.optim.Adam(list(a.values()) + list(b.values()) + list(c.values()), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    with training_pass(model):
        for step in tqdm(range(steps), desc="int4 grid tuning (end to end)", unit="step", disable=not progress,
                         leave=False):
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            x = ids[torch.randperm(num_seqs, generator=gen)[:per_step].to(device)].reshape(-1)
            with torch.no_grad():
                teacher = F.log_softmax(F.linear(model(x, positions, meta), head).float(), dim=-1)
            student = F.log_softmax(F.linear(functional_call(model, weights(), (x, positions, meta)),
                                             student_head).float(), dim=-1)
            loss = (teacher.exp() * (teacher - student)).sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    tuned = dict(parts)
    with torch.no_grad():
        for key in keys:   # exactly the bf16 values (x + (r - x) in fp32 may miss r by an ulp)
            scale, zero = (t.to(torch.bfloat16).float().cpu() for t in grid(key))
            tuned[key] = (parts[key][0], scale, zero)
        scales = dict(input_scales)
        scales.update({key: input_scale(key).detach().cpu() for key in c})
    return scales, tuned


CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "data" / "calibration.txt"


def calibration_token_ids(tokenizer, num_tokens: int = 512, vocab_size: int | None = None) -> list[int]:
    """The first `num_tokens` tokens of minillm/data/calibration.txt: original prose kept apart
    from data/corpus.txt, which the quality harness scores, so calibration never sees the
    evaluation text. (Fixed pseudo-random ids for random-weight presets, which have no tokenizer.)"""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size or 2, (num_tokens,), generator=g).tolist()
    return tokenizer.encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)[:num_tokens]


GENERATED_CALIBRATION_TEXT = CALIBRATION_TEXT.with_name("calibration_generated.txt")


def autoround_token_ids(tokenizer, vocab_size: int | None = None) -> list[int]:
    """weight_calibration="autoround"'s calibration tokens: data/calibration.txt, then
    data/calibration_generated.txt (128 essays the default model wrote at temperature 1,
    scripts/make_calibration_text.py; about 63,600 tokens together). Learned rounding fits ~1,100
    tokens too closely, and the model's own text at temperature 0.8 was too easy for it (perplexity
    2-3) to stand for real text. (2,048 fixed
    pseudo-random ids for random-weight presets.)"""
    if tokenizer is None:
        return calibration_token_ids(None, 2048, vocab_size)
    text = CALIBRATION_TEXT.read_text() + "\n\n" + GENERATED_CALIBRATION_TEXT.read_text()
    return tokenizer.encode(text, add_special_tokens=False)


CALIBRATION_CACHE_VERSION = 2  # bumped whenever a calibration's algorithm changes: the key does not cover the code


def calibration_cache_dir() -> Path:
    from .default import cache_root

    return cache_root() / "calibration"


def calibration_cache_path(name: str, model: LlamaForCausalLM, token_ids: list[int], recipe: dict) -> Path:
    """Where cached_calibration keeps (or will keep) this calibration: the file name is keyed by the
    model's float weights, the calibration tokens and the recipe."""
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((CALIBRATION_CACHE_VERSION, name, sorted(recipe.items()))).encode())
    digest.update(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return calibration_cache_dir() / f"{name}-{digest.hexdigest()}.pt"


def cached_calibration(name: str, model: LlamaForCausalLM, token_ids: list[int], recipe: dict, compute):
    """compute() -> (input_scales, int4 parts), kept on disk at calibration_cache_path(): a
    calibration that takes minutes (AutoRound: about 20 on 2 CPU cores, its end-to-end tuning about
    35 more) runs once per model and setting. Parts are stored packed, two weights per byte."""
    from ..quant.int4 import pack_int4, unpack_int4

    path = calibration_cache_path(name, model, token_ids, recipe)
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        return saved["scales"], {k: (unpack_int4(q), scale, zero) for k, (q, scale, zero) in saved["parts"].items()}
    scales, parts = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"scales": {k: v.cpu() for k, v in scales.items()},
                "parts": {k: (pack_int4(q), scale.cpu(), zero.cpu()) for k, (q, scale, zero) in parts.items()}}, tmp)
    os.replace(tmp, path)
    return scales, parts


def autoround_recipe(group_size: int) -> dict:
    """calibrate_autoround's cache recipe (the first stage of weight_calibration="autoround"). One entry
    serves both heads: the int4 head's GPTQ (HEAD_INT4_GROUP_SIZE) is always computed, in seconds,
    and dropped under an int8 head."""
    return dict(group_size=group_size, steps=AUTOROUND_STEPS, batch_tokens=AUTOROUND_BATCH_TOKENS,
                head_group_size=HEAD_INT4_GROUP_SIZE,
                relative="above-median",      # the cache key's name for relative=True
                rotation="hadamard-down")     # down_proj's input rotated first (rotate_down_proj)


def tuned_autoround_recipe(group_size: int) -> dict:
    """weight_calibration="autoround"'s cache recipe: AutoRound's, then tune_int4_grids'."""
    return dict(autoround_recipe(group_size), e2e_steps=E2E_STEPS, e2e_lr=E2E_LR, e2e_batch_tokens=E2E_BATCH_TOKENS)


def autoround_cache_path(model: LlamaForCausalLM, tokenizer, group_size: int = 128) -> Path:
    """The cache entry weight_calibration="autoround" at group_size reads (or will write)."""
    ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
    return calibration_cache_path("autoround-tuned", down_rotated(model, group_size), ids,
                                  tuned_autoround_recipe(group_size))


def autoround_is_cached(model: LlamaForCausalLM, tokenizer, group_size: int = 128) -> bool:
    """Whether weight_calibration="autoround" at group_size would read its calibration from the cache
    (False: building it runs calibrate_autoround and tune_int4_grids, about 60 min for SmolLM2-135M
    on 2 CPU cores, or about 35 when AutoRound's own stage is cached)."""
    return autoround_cache_path(model, tokenizer, group_size).is_file()


def autoround_calibration(model: LlamaForCausalLM, tokenizer, group_size: int = 128
                          ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """weight_calibration="autoround"'s (input_scales, parts), from the cache or computed (and cached):
    calibrate_autoround (cached on its own, so a change to the tuning reruns only the tuning), then
    tune_int4_grids on the same calibration tokens. The parts are for the model with down_proj's input
    rotated (rotate_down_proj; quantize_for_config rotates the model it quantizes): an unrotated
    `model` is calibrated through a rotated shallow copy, and left as it was."""
    model = down_rotated(model, group_size)
    ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
    recipe = tuned_autoround_recipe(group_size)   # the calls below read the key's values: they cannot drift apart

    def layer_by_layer():
        return cached_calibration("autoround", model, ids, autoround_recipe(group_size),
                                  lambda: calibrate_autoround(model, ids, recipe["group_size"], steps=recipe["steps"],
                                                              batch_tokens=recipe["batch_tokens"],
                                                              head_group_size=recipe["head_group_size"]))

    def tuned():
        scales, parts = layer_by_layer()
        return tune_int4_grids(model, ids, scales, parts, steps=recipe["e2e_steps"], lr=recipe["e2e_lr"],
                               batch_tokens=recipe["e2e_batch_tokens"])

    return cached_calibration("autoround-tuned", model, ids, recipe, tuned)


def gptq_tuned_recipe(group_size: int) -> dict:
    """weight_calibration="gptq-tuned"'s cache recipe: "gptq"'s calibration, then tune_int4_grids with the
    input scales learned too and the int8 head in the student. One entry serves both heads, as for
    autoround: the int4 head's GPTQ (before the tuning) is kept and dropped under an int8 head."""
    return dict(group_size=group_size, gptq_tokens=GPTQ_TOKENS, **GPTQ_OPTIONS, head_group_size=HEAD_INT4_GROUP_SIZE,
                rotation="hadamard-down+norms", e2e_steps=E2E_STEPS, e2e_lr=E2E_LR, e2e_batch_tokens=E2E_BATCH_TOKENS,
                tune_input_scales=True, student_head="int8")


def gptq_tuned_cache_path(model: LlamaForCausalLM, tokenizer, group_size: int = 128) -> Path:
    """The cache entry weight_calibration="gptq-tuned" at group_size reads (or will write)."""
    ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
    return calibration_cache_path("gptq-tuned", int4_rotated(model, group_size), ids, gptq_tuned_recipe(group_size))


def gptq_tuned_calibration(model: LlamaForCausalLM, tokenizer, group_size: int = 128
                           ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """weight_calibration="gptq-tuned"'s (input_scales, parts), from the cache or computed (and cached,
    about 40 min for SmolLM2-135M on 2 CPU cores): calibrate_gptq as weight_calibration="gptq" runs it
    (the first GPTQ_TOKENS calibration tokens), then tune_int4_grids on all of autoround_token_ids,
    the input scales learned too, against the int8 head the engine serves. The parts are for the
    model with down_proj's input and the norm outputs rotated (int4_rotated); an unrotated `model`
    is calibrated through a rotated shallow copy, and left as it was."""
    model = int4_rotated(model, group_size)
    ids = autoround_token_ids(tokenizer, vocab_size=model.cfg.vocab_size)
    recipe = gptq_tuned_recipe(group_size)   # the calls below read the key's values: they cannot drift apart

    def compute():
        scales, parts = calibrate_gptq(model, ids[:recipe["gptq_tokens"]], recipe["group_size"],
                                       head_group_size=recipe["head_group_size"], **{k: recipe[k] for k in GPTQ_OPTIONS})
        return tune_int4_grids(model, ids, scales, parts, steps=recipe["e2e_steps"], lr=recipe["e2e_lr"],
                               batch_tokens=recipe["e2e_batch_tokens"], tune_input_scales=recipe["tune_input_scales"],
                               head_dtype=recipe["student_head"])

    return cached_calibration("gptq-tuned", model, ids, recipe, compute)


def quantize_for_config(model: LlamaForCausalLM, weight_dtype: str, group_size: int, calibration: str | None,
                        tokenizer, in_place: bool, head_dtype: str = "auto") -> LlamaForCausalLM:
    """What the engine does for weight_dtype / weight_group_size / weight_calibration (/ weight_head_dtype:
    head_dtype is that lever's value, resolved by head_dtype_for). EngineConfig has checked the
    combination (gptq and autoround need int4)."""
    scales = clips = parts = None
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
