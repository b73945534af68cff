"""AWQ calibration of a model (weight_calibration="awq"): each decoder matrix's input scale and
int4 clipping ranges, searched on the float model's activations. The searches themselves are in
quant/awq.py (search_input_scale, search_clip); clip_weight applies the ranges at quantization."""

from __future__ import annotations

import torch

from ...layers.activation import silu_and_mul
from ...layers.attention import AttentionMetadata
from ...quant import QuantizedLinear
from ...quant.awq import search_clip, search_input_scale
from ..llama import LlamaForCausalLM
from .common import LAYER_LINEARS

AWQ_SEARCH_TOKENS = 512  # calibrate_gptq / calibrate_autoround: tokens the input-scale search scores


def awq_module(layer, name: str, positions: torch.Tensor, meta: AttentionMetadata):
    """What a matrix's input-scale search scores (search_input_scale's module=), as llm-awq does:
    qkv_proj -> (x, W) -> attention and o_proj; gate_up_proj -> (x, W) -> SiLU-and-mul and down_proj
    (the rest of the block in float, on the calibration sequence's positions); o_proj and down_proj
    feed the residual stream directly: None (their own output)."""
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
    MLP's (awq_module, llm-awq's choice); "linear" scores every matrix on its own output.
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
