"""A decode step's decoder layers in one call to minillm's CPU kernels (kernels/cpu.py `decode_layers`).

With the CPU kernels on (attention_backend "cpu": the pass's ops "cpu"), each of a decoder
layer's steps is already one C call: the norms, the four projections, rotary, the KV store and the
attention. What is left at batch 1 is Python between them: about ten wrapper calls per layer, each
checking its tensors and allocating its output, plus the modules' own dispatch, some 8,000 Python
function calls per token on SmolLM2-135M, 3 to 5 ms of a 30 ms step. For a decode step (every
sequence one new token, an fp32 KV pool, block tables) this module hands all the layers to C at
once: `cpu_decode_layers.c`'s minillm_decode_layers runs the same kernels in the same order with the same
arguments, so the logits are the same bits as the layer-by-layer path (tests/test_cpu_kernels.py
checks it), and DecoderLayer.forward_fused stays the code to read.

The tables of pointers (`CPUDecodePlan`) are built from the model's tensors and the engine's KV pool on the
first decode step and kept, in the model runner's ForwardContext.cpu_plans, while every tensor they point at
is the same one; anything the fused path does not cover sends the step back to the layer-by-layer path: a
prompt chunk, a quantized KV pool, a step with LoRA adapters, a mixture-of-experts layer, rotated norms, a
plugged-in quantized matmul (seams.QuantizedMatmul) or attention backend, a forward hook, a format without a
CPU kernel, or more rows than the kernels take. `runner.fuse_cpu_decode = False` turns it off
(`python -m minillm.bench.quant_speed --fuse-compare` prints both).
"""

from __future__ import annotations

import torch

from ..kernels import cpu
from ..layers.attention import CPUAttentionBackend
from ..layers.context import ForwardContext, ModelParts
from ..layers.linear import Linear, MAX_ROWS
from ..layers.norm import RMSNorm
from ..quant.linear import QuantizedLinear


def _mat(module, parts: ModelParts) -> tuple[cpu.Mat, int, list[torch.Tensor]] | None:
    """(the projection's minillm_mat, the most rows its kernel takes, the tensors it points at), or None when
    its forward would not be one of the CPU kernels (`parts`: the engine's plug-ins)."""
    from ..quant.linear_int4 import Int4Linear
    from ..quant.linear_int8 import Int8Linear

    if module._forward_hooks or module._forward_pre_hooks:
        return None
    bias = getattr(module, "bias", None)
    if bias is not None and not (bias.dtype is torch.float32 and bias.is_contiguous()):
        return None
    kind = type(module)
    if kind is Linear:
        w = module.weight
        if not (w.dtype is torch.float32 and w.is_contiguous() and w.device.type == "cpu"):
            return None
        n, k = w.shape
        return cpu.Mat(0, n, k, k, 0, w.data_ptr(), None, None, bias.data_ptr() if bias is not None else None), \
            min(cpu.KERNEL_ROWS, MAX_ROWS), [w, bias]
    if kind not in (Int8Linear, Int4Linear) or module.path != "cpu" or parts.matmul_for(module) is not None \
            or module.inv_input_scale is not None or module.act_dtype != torch.float32:
        return None
    b = bias.data_ptr() if bias is not None else None
    if kind is Int8Linear:
        return cpu.Mat(1, module.out_features, module.in_features, module.in_features, 0, module.q.data_ptr(),
                       module.scale.data_ptr(), None, b), cpu.QUANT_KERNEL_ROWS, [module.q, module.scale, bias]
    kp = module.in_features + module.pad
    return cpu.Mat(2, module.out_features, module.in_features, kp, module.group_size, module.packed.data_ptr(),
                   module.scale.data_ptr(), module.zero.data_ptr(), b), cpu.QUANT_KERNEL_ROWS, \
        [module.packed, module.scale, module.zero, bias]


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _parts(layer, kv) -> list:
    """Everything of a layer a plan points at or depends on, by identity (modules, their parameters, buffers and
    the quantized path, the layer's KV pool): when any of them is another object, the plan is built again."""
    modules = layer._modules
    parts = [layer, kv.k[layer.index], kv.v[layer.index], layer.moe]
    parts += layer._buffers.values()
    for name in ("input_layernorm", "post_attention_layernorm") + PROJECTIONS:
        module = modules.get(name)
        parts.append(module)
        if module is not None:
            parts += module._parameters.values()
            parts += module._buffers.values()
            parts.append(module.path if isinstance(module, QuantizedLinear) else None)   # the path its forward takes
    return parts


def _key(model, layers, ctx: ForwardContext) -> list:
    rotary = model.rotary
    return [rotary.cos, rotary.sin, ctx.backend, ctx.parts] + [p for layer in layers for p in _parts(layer, ctx.kv)]


class CPUDecodePlan:
    """The ctypes tables minillm_decode_layers reads (cpu.Layer per layer), built from the model's tensors;
    `fits` is False when some layer cannot go through the fused path (then the model keeps its layers)."""

    def __init__(self, model, layers, layer_type: type, ctx: ForwardContext):
        self.key = _key(model, layers, ctx)
        # the modules whose forward the fused path replaces: a forward hook on any of them needs the layers
        self.modules = [m for layer in layers for m in (layer, layer.attn, *layer.children())]
        self.hooked = self._hooked()
        self.fits, self.max_rows, self.tensors = False, 0, []
        cfg = model.cfg
        rotary = model.rotary
        if self.hooked or not layers or type(ctx.backend) is not CPUAttentionBackend or ctx.kv.quantized \
                or not (rotary.cos.dtype is torch.float32 and rotary.cos.is_contiguous() and rotary.sin.is_contiguous()):
            return
        table, max_rows, max_k, keep = (cpu.Layer * len(layers))(), MAX_ROWS, 0, [rotary.cos, rotary.sin]
        first = layers[0]
        first_norm = first.input_layernorm
        first_k = ctx.kv.k[first.index]
        for i, layer in enumerate(layers):
            attn = layer.attn
            k_cache, v_cache = ctx.kv.k[layer.index], ctx.kv.v[layer.index]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if type(layer) is not layer_type or layer.moe is not None or layer.down_rotation is not None \
                    or k_cache.dtype is not torch.float32 or any(type(n) is not RMSNorm or n.rotation is not None
                                                                 for n in norms):
                return
            if norms[0].eps != first_norm.eps or norms[1].eps != first_norm.eps or attn.scale != first.attn.scale \
                    or k_cache.shape != first_k.shape:
                return
            mats = [_mat(getattr(layer, name), ctx.parts) for name in PROJECTIONS]
            if any(m is None for m in mats):
                return
            for (mat, rows, tensors) in mats:
                max_rows = min(max_rows, rows)
                max_k = max(max_k, mat.Kp)
                keep += tensors
            table[i] = cpu.Layer(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), *(m[0] for m in mats),
                                 k_cache.data_ptr(), v_cache.data_ptr())
            keep += [norms[0].weight, norms[1].weight, k_cache, v_cache]
        self.table, self.max_rows, self.tensors = table, max_rows, keep
        self.step = cpu.Step(H=cfg.hidden_size, hq=cfg.num_heads, hk=cfg.num_kv_heads, D=cfg.head_dim,
                             I=cfg.intermediate_size, num_slots=first_k.shape[1], max_k=max_k,
                             eps=first_norm.eps, scale=first.attn.scale,
                             cos=rotary.cos.data_ptr(), sin=rotary.sin.data_ptr())
        self.fits = True

    def still_current(self, model, layers, ctx: ForwardContext) -> bool:
        parts = _key(model, layers, ctx)
        return len(parts) == len(self.key) and all(a is b for a, b in zip(parts, self.key)) \
            and self._hooked() == self.hooked

    def _hooked(self) -> bool:
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)


def run(model, layers, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, layer_type: type):
    """The decoder layers of a decode step in one C call: (delta, residual) as the layer-by-layer loop in
    LlamaForCausalLM.forward leaves them, or None when this step or model is not one the fused path covers
    (``layer_type``: the decoder layer class whose forward_fused it reproduces; a subclass goes layer by layer).
    The plan is kept in ctx.cpu_plans (the runner's), by layer count: a "self" draft runs the first few."""
    m, meta = hidden.shape[0], ctx.meta
    if not (ctx.cpu_plans is not None and ctx.kv is not None and ctx.lora is None and meta.use_cache
            and meta.max_query_len == 1 and meta.block_tables is not None and len(meta.query_lens) == m
            and hidden.dtype is torch.float32 and hidden.is_contiguous()):
        return None
    plans = ctx.cpu_plans
    plan = plans.get(len(layers))
    if plan is None or not plan.still_current(model, layers, ctx):
        plan = plans[len(layers)] = CPUDecodePlan(model, layers, layer_type, ctx)
    if not plan.fits or m > plan.max_rows:
        return None
    tables, lens = meta.block_tables, meta.seq_lens
    slots = meta.slot_mapping
    if not (tables.dtype is torch.int32 and lens.dtype is torch.int32 and positions.dtype is torch.int64
            and slots.dtype is torch.int64 and tables.is_contiguous() and lens.is_contiguous()
            and positions.is_contiguous() and slots.is_contiguous()):
        return None
    step = plan.step
    step.m, step.block_size, step.max_blocks = m, meta.block_size, tables.shape[1]
    step.max_len = max(1, max(c + n for c, n in zip(meta.num_cached, meta.query_lens)))
    step.pos, step.slots = positions.data_ptr(), slots.data_ptr()
    step.block_tables, step.seq_lens = tables.data_ptr(), lens.data_ptr()
    delta = torch.empty_like(hidden)
    cpu.decode_layers(plan.table, step, hidden, delta, has_delta=False)
    return delta, hidden
