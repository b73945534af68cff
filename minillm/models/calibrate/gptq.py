"""GPTQ calibration of a model (weight_calibration="gptq", and the first stage of "gptq-tuned"):
every decoder matrix quantized to int4 in order, each on the activations of the int4 matrices
before it. The algorithm on one matrix is in quant/gptq.py (gptq_int4)."""

from __future__ import annotations

import torch

from ...layers.activation import silu_and_mul
from ...layers.attention import AttentionMetadata
from ...quant import QuantizedLinear
from ...quant.awq import search_clip, search_input_scale
from ...quant.gptq import gptq_int4, input_hessian
from ...quant.int4 import dequantize_int4
from ..llama import LlamaForCausalLM
from .awq import AWQ_SEARCH_TOKENS
from .common import LAYER_LINEARS

GPTQ_TOKENS = 4096  # calibration tokens for weight_calibration="gptq": the first of autoround_token_ids
GPTQ_OPTIONS = dict(act_order="static", clip=True)  # its calibrate_gptq options (also gptq-tuned's first stage)


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
