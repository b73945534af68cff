"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE): router, top-k routing, experts, shared expert.

A sparse MoE layer replaces the dense SwiGLU MLP by E smaller ones (experts) and a router: each
token's router logits -> softmax (fp32) -> top-k -> renormalised to sum to 1 (Mixtral always;
Qwen2-MoE when norm_topk_prob) -> the token's output is the weighted sum of its k experts' outputs.
Qwen2-MoE adds a shared expert every token goes through, scaled by sigmoid(shared_expert_gate(x)).
A token multiplies by k of E experts (Mixtral 8x7B: 12.9B of 46.7B parameters), but a batch of B
tokens touches E * (1 - (1 - k/E)^B) experts per layer on average: at batch 1 decode reads only the
routed experts, at batch 64 nearly all of them (`expected_experts_touched`, `decode_step_bytes`).

Experts are stored stacked, w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], vLLM's layout;
the dispatch is the torch loop over experts (kernels/fused_moe.py experts_reference) or the Triton
fused-MoE kernel (the pass's ops "triton"). The weight_dtype lever quantizes each
expert matrix (QuantizedExperts): the torch path dequantizes the experts a step hits, the Triton
kernel reads int8 and int4 experts as they are stored (fp8 experts take the torch path).

Each block counts the tokens routed to each expert in every pass into the pass's ForwardContext
(expert_tokens); the engine sums them per step into StepStats.expert_tokens (expert_token_counts).
An engine built with moe_router= / moe_experts= (seams.MoERouter, seams.MoEExperts) routes and
dispatches with those instead (check_moe_parts says which models take them).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.activation import silu_and_mul
from ..layers.context import ForwardContext
from ..layers.linear import Linear, linear
from ..quant import QuantizedLinear, WEIGHT_DTYPES
from ..quant import dequantize_fp8, dequantize_int4, dequantize_int8, pack_int4, quantize_fp8, quantize_int4, quantize_int8
from ..quant import unpack_int4
from .config import ModelConfig


def route(router_logits: torch.Tensor, top_k: int, normalize: bool, weights_in_logits_dtype: bool):
    """router_logits [T, E] -> (weights [T, k], expert ids [T, k]), as transformers' routers do:
    softmax in fp32, top-k, renormalised when `normalize`; the weights stay fp32 (Mixtral) or are
    rounded to the logits' dtype (Qwen2-MoE, weights_in_logits_dtype)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_logits_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, ids


class Experts(nn.Module):
    """E SwiGLU experts, stacked: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], in the model dtype."""

    weight_dtype: str | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of expert e in dtype."""
        return self.w13[e].to(dtype), self.w2[e].to(dtype)

    def forward(self, x, topk_weights, topk_ids, use_triton: bool = False) -> torch.Tensor:
        if use_triton:
            from ..kernels import fused_moe  # imported late: the interpreter is chosen before triton is imported

            return fused_moe.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        return _experts_loop(x, topk_weights, topk_ids, self)


def _experts_loop(x, topk_weights, topk_ids, experts) -> torch.Tensor:
    from ..kernels.fused_moe import experts_reference  # pure torch, but in the kernel's file (one concept)

    return experts_reference(x, topk_weights, topk_ids, experts.num_experts,
                             lambda e: experts.expert(e, x.dtype), linear=linear)


class QuantizedExperts(nn.Module):
    """Experts in weight_dtype: each expert matrix quantized as QuantizedLinear would store it
    (int8 / fp8: one fp32 scale per output row; int4: groups of group_size input channels, asymmetric,
    packed two per byte, the input dimension padded to the group). Stored as frozen parameters, so
    quant/linear.py weight_bytes counts them."""

    def __init__(self, experts: Experts, weight_dtype: str, group_size: int = 128):
        super().__init__()
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={weight_dtype!r} is not one of {WEIGHT_DTYPES}")
        self.weight_dtype, self.group_size = weight_dtype, group_size if weight_dtype == "int4" else None
        self.num_experts, self.hidden_size = experts.num_experts, experts.hidden_size
        self.intermediate_size, self.act_dtype = experts.intermediate_size, experts.w13.dtype
        for name in ("w13", "w2"):
            parts = [self._quantize(m) for m in getattr(experts, name).data]
            for i, part in enumerate(zip(*parts)):
                setattr(self, f"{name}_{i}", nn.Parameter(torch.stack(part), requires_grad=False))

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.weight_dtype == "int8":
            return quantize_int8(w)
        if self.weight_dtype == "fp8":
            return quantize_fp8(w)
        q, scale, zero = quantize_int4(F.pad(w.float(), (0, (-w.shape[1]) % self.group_size)), self.group_size)
        return pack_int4(q), scale, zero

    def _dequantize(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        parts = [getattr(self, f"{name}_{i}")[e] for i in range(3 if self.weight_dtype == "int4" else 2)]
        if self.weight_dtype == "int8":
            return dequantize_int8(*parts, dtype)
        if self.weight_dtype == "fp8":
            return dequantize_fp8(*parts, dtype)
        k = self.hidden_size if name == "w13" else self.intermediate_size
        return dequantize_int4(unpack_int4(parts[0]), parts[1], parts[2], dtype)[:, :k]

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of expert e, dequantized to dtype."""
        return self._dequantize("w13", e, dtype), self._dequantize("w2", e, dtype)

    def forward(self, x, topk_weights, topk_ids, use_triton: bool = False) -> torch.Tensor:
        if use_triton and self.weight_dtype in ("int8", "int4"):   # fp8 experts: the torch loop
            from ..kernels import fused_moe

            w13, w2 = ((fused_moe.ExpertWeights(getattr(self, f"{name}_0"), getattr(self, f"{name}_1"),
                                                getattr(self, f"{name}_2", None), self.group_size))
                       for name in ("w13", "w2"))
            return fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
        return _experts_loop(x, topk_weights, topk_ids, self)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"weight_dtype={self.weight_dtype}{group}")


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer: x [T, H] (after post_attention_layernorm) -> [T, H]."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.index = index                                              # the decoder layer's
        self.num_experts, self.top_k, self.normalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weights_in_logits_dtype = cfg.model_type == "qwen2_moe"   # its router rounds the weights
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)            # the router (kept in the model dtype)
        self.experts: Experts | QuantizedExperts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        shared = cfg.shared_expert_intermediate_size
        self.shared_gate_up = Linear(cfg.hidden_size, 2 * shared) if shared else None
        self.shared_down = Linear(shared, cfg.hidden_size) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1) if shared else None

    def route(self, x: torch.Tensor, router=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k]); `router`: an engine's moe_router part."""
        logits = linear(x, self.gate.weight)
        if router is not None:
            return router(logits, self.top_k)
        return route(logits, self.top_k, self.normalize, self.weights_in_logits_dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        ctx = ForwardContext.of(ctx)
        parts = ctx.parts
        weights, ids = self.route(x, parts.moe_router)
        self._count(ids, ctx.expert_tokens)
        if parts.moe_experts is not None:
            out = parts.moe_experts(x, weights, ids, self.experts.w13, self.experts.w2).to(x.dtype)
        else:
            out = self.experts(x, weights, ids, use_triton=ctx.ops == "triton")
        if self.shared_gate_up is not None:
            shared = self.shared_down(silu_and_mul(self.shared_gate_up(x), "triton" if ctx.ops == "triton" else "torch"))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def _count(self, ids: torch.Tensor, into: dict) -> None:
        """Add this pass's tokens per expert to `into[self.index]` (the pass's ForwardContext.expert_tokens)."""
        if ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return   # a captured graph's replays run no Python: those steps carry no expert counts
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int64, device=ids.device))
        into[self.index] = counts if self.index not in into else into[self.index] + counts

    def quantized(self, weight_dtype: str, group_size: int = 128, fast: bool = True) -> "SparseMoeBlock":
        """A copy with the experts and the shared expert in weight_dtype (the router and the shared
        expert's gate, one row, stay in the model dtype); this block is left as it was."""
        new = copy.copy(self)
        new._modules, new._parameters, new._buffers = dict(self._modules), dict(self._parameters), dict(self._buffers)
        new.experts = QuantizedExperts(self.experts, weight_dtype, group_size)
        if self.shared_gate_up is not None:
            for name in ("shared_gate_up", "shared_down"):
                layer = getattr(self, name)
                setattr(new, name, QuantizedLinear.from_float(layer.weight.data, None, weight_dtype, group_size, fast=fast))
        return new


def moe_blocks(model) -> list[SparseMoeBlock]:
    """The model's MoE blocks, in layer order ([] for a dense model)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def check_moe_parts(model, router=None, experts=None) -> None:
    """Refuse moe_router= / moe_experts= parts on a model that cannot take them: a dense model, or blocks that
    are not Mixtral-style (renormalised top-k, no shared expert, experts in the model dtype)."""
    if router is None and experts is None:
        return
    names = ", ".join(n for n, part in (("moe_router", router), ("moe_experts", experts)) if part is not None)
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{names}: this model has no mixture-of-experts layers ({model.cfg.model_type}, a dense "
                         "model); build the LLM on a Mixtral-style model, e.g. model='random:tiny-mixtral'")
    if any(not b.normalize or b.shared_gate_up is not None or isinstance(b.experts, QuantizedExperts) for b in blocks):
        raise ValueError(f"{names}: Mixtral-style MoE only (renormalised top-k, no shared expert, experts in the "
                         f"model dtype); this model's blocks ({model.cfg.model_type}) are not")


def expert_token_counts(model, counts: dict) -> list[list[int]] | None:
    """A pass's (or a step's) ForwardContext.expert_tokens as [moe_layer][expert] in layer order (each token
    counts once per expert it chose). None: a dense model, or no pass counted (a replayed CUDA graph)."""
    if not model.cfg.num_experts or not counts:
        return None
    blocks = moe_blocks(model)
    zeros = next(iter(counts.values())).new_zeros(blocks[0].num_experts)
    return torch.stack([counts.get(b.index, zeros) for b in blocks]).tolist()


# ------------------------------------------------------------------ checkpoint names
def moe_checkpoint_place(cfg: ModelConfig, module: str, kind: str):
    """A checkpoint tensor inside a MoE layer ("block_sparse_moe.experts.3.w1", "weight") -> (our parameter
    suffix within the layer, index into it (None: the whole tensor), part key) or None when it is not a
    MoE tensor. Both checkpoint layouts: per expert (Mixtral w1/w3/w2, Qwen2-MoE gate/up/down_proj) and
    transformers 5's stacked experts.gate_up_proj / experts.down_proj."""
    for prefix in ("block_sparse_moe.", "mlp."):
        if module.startswith(prefix):
            rest = module[len(prefix):]
            break
    else:
        return None
    inter, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    if rest == "gate":
        return "moe.gate.weight", None, ""
    if rest == "shared_expert_gate":
        return "moe.shared_expert_gate.weight", None, ""
    if rest.startswith("shared_expert."):
        proj = rest[len("shared_expert."):]
        places = {"gate_proj": ("moe.shared_gate_up.weight", slice(0, shared), "gate"),
                  "up_proj": ("moe.shared_gate_up.weight", slice(shared, 2 * shared), "up"),
                  "down_proj": ("moe.shared_down.weight", None, "")}
        return places.get(proj)
    if rest in ("experts", "experts.gate_up_proj", "experts.down_proj"):   # stacked: the tensor name's last part
        name = kind if rest == "experts" else rest.rsplit(".", 1)[1]
        return {"gate_up_proj": ("moe.experts.w13", None, ""), "down_proj": ("moe.experts.w2", None, "")}.get(name)
    if rest.startswith("experts."):
        _, e, proj = rest.split(".", 2)
        e = int(e)
        places = {"w1": ("moe.experts.w13", (e, slice(0, inter)), f"{e}.gate"),
                  "gate_proj": ("moe.experts.w13", (e, slice(0, inter)), f"{e}.gate"),
                  "w3": ("moe.experts.w13", (e, slice(inter, 2 * inter)), f"{e}.up"),
                  "up_proj": ("moe.experts.w13", (e, slice(inter, 2 * inter)), f"{e}.up"),
                  "w2": ("moe.experts.w2", (e,), f"{e}"),
                  "down_proj": ("moe.experts.w2", (e,), f"{e}")}
        return places.get(proj) if 0 <= e < cfg.num_experts else None
    return None


def moe_expected_parts(cfg: ModelConfig, suffix: str) -> list[str]:
    """The part keys moe_checkpoint_place gives a MoE parameter (suffix within the layer), all of which a
    per-expert checkpoint must fill ([""]: the tensor whole)."""
    if suffix == "moe.experts.w13":
        return [f"{e}.{half}" for e in range(cfg.num_experts) for half in ("gate", "up")]
    if suffix == "moe.experts.w2":
        return [str(e) for e in range(cfg.num_experts)]
    if suffix == "moe.shared_gate_up.weight":
        return ["gate", "up"]
    return [""]


# ------------------------------------------------------------------ bytes read per decode step
def expected_experts_touched(num_experts: int, top_k: int, batch_size: int) -> float:
    """Expected distinct experts a layer reads for batch_size tokens routed uniformly: each token picks
    top_k of num_experts, so an expert is missed by all with probability (1 - k/E)^B."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if batch_size < 0:
        raise ValueError(f"batch_size={batch_size} must be >= 0")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch_size)


def decode_step_bytes(cfg: ModelConfig, batch_size: int, context_len: int = 0, bytes_per_param: float = 2.0,
                      kv_bytes_per_value: int = 2, experts_touched: float | None = None) -> dict[str, float]:
    """Bytes one decode step of batch_size sequences (each with context_len tokens cached) must read:
    every non-expert weight once (attention, norms, dense MLPs, routers, shared experts, the head; the
    embedding's batch_size rows), the experts touched in each MoE layer (experts_touched per layer,
    default expected_experts_touched under uniform routing), and the KV cache. bytes_per_param: 2 for
    bf16, 1 for int8, ~0.56 for int4 in groups of 128. A dense model: experts 0."""
    h = cfg.hidden_size
    moe_layers = cfg.num_moe_layers
    expert_params = 3 * h * cfg.moe_intermediate_size
    if moe_layers and experts_touched is None:
        experts_touched = expected_experts_touched(cfg.num_experts, cfg.num_experts_per_tok, batch_size)
    embed = cfg.vocab_size * h
    non_expert = cfg.num_params - moe_layers * cfg.num_experts * expert_params - embed * (not cfg.tie_word_embeddings)
    weights = (non_expert + batch_size * h * (not cfg.tie_word_embeddings)) * bytes_per_param
    experts = moe_layers * (experts_touched or 0.0) * expert_params * bytes_per_param
    kv = batch_size * context_len * cfg.kv_bytes_per_token(kv_bytes_per_value)
    return {"weights": weights, "experts": experts, "kv": float(kv), "total": weights + experts + kv,
            "experts_touched_per_layer": float(experts_touched or 0.0)}
