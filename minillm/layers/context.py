"""ForwardContext: everything one forward pass needs that is not a weight, built by the model runner.

The model holds weights only. Which KV pool its attention layers read, which attention backend walks it,
which kernels run the small ops, the step's LoRA batch and the parts an engine was built with (a lab's
quantized matmul, LoRA delta, MoE router and experts: minillm/seams.py) travel in this one object,
passed down `model.forward(input_ids, positions, ctx)` -> each decoder layer -> its modules. Two engines
that share a model's weights (`LLM.with_levers`) build their own contexts, so they share nothing else:

    meta          AttentionMetadata: the step's batch layout (layers/attention.py)
    backend       the attention backend object (seams.py's protocols)
    kv            the engine's KV pool (engine/kv_cache.py: k[i], v[i], k_scale[i], v_scale[i]); None: no pool
    ops           "torch" | "triton" | "cpu": who runs RMSNorm, rotary and SiLU-and-mul
    parts         ModelParts: the engine's plug-ins (None each: the built-in one)
    lora          the step's LoRABatch (layers/lora.py); None: no adapter in this step
    expert_tokens {MoE layer index: [E] int64 tokens routed}, filled by the MoE layers for the runner
    cpu_plans     the runner's fused CPU decode plans by layer count (models/cpu_decode.py); None: off

A whole-sequence pass with no pool (calibration, perplexity) passes its AttentionMetadata alone:
`ForwardContext.of(meta)` gives it the torch reference everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

OPS = ("torch", "triton", "cpu")


@dataclass(frozen=True)
class ModelParts:
    """An engine's plug-ins inside the model (LLM(quantized_matmul=..., lora_delta=..., moe_router=...,
    moe_experts=...)), each checked against its protocol in minillm/seams.py when the engine is built.

    quantized_matmul   y = fn(x2d, layer) for each QuantizedLinear of format `quantized_dtype`
    lora_delta         delta = fn(x, a, b, batch) for each adapted projection (enable_lora=True)
    moe_router         (weights, ids) = fn(router_logits, top_k) in each MoE layer
    moe_experts        out = fn(x, weights, ids, w13, w2) in each MoE layer
    """

    quantized_matmul: Callable | None = None
    quantized_dtype: str | None = None
    lora_delta: Callable | None = None
    moe_router: Callable | None = None
    moe_experts: Callable | None = None

    def matmul_for(self, layer) -> Callable | None:
        """The plugged matmul for a QuantizedLinear `layer`, or None (its own path)."""
        if self.quantized_matmul is None or layer.weight_dtype != self.quantized_dtype:
            return None
        return self.quantized_matmul


NO_PARTS = ModelParts()


@dataclass
class ForwardContext:
    meta: Any                                  # AttentionMetadata
    backend: Any = None                        # None: the torch reference (layers/attention.py)
    kv: Any = None                             # KVCache or None
    ops: str = "torch"
    parts: ModelParts = NO_PARTS
    lora: Any = None                           # LoRABatch or None
    expert_tokens: dict = field(default_factory=dict)
    cpu_plans: dict | None = None

    def __post_init__(self):
        if self.ops not in OPS:
            raise ValueError(f"ops={self.ops!r} is not one of {OPS}")

    @classmethod
    def of(cls, meta_or_ctx=None) -> "ForwardContext":
        """A ForwardContext as it is, or a pool-less one (torch everywhere) around an AttentionMetadata (None: a
        module called on its own, outside a model pass: an MLP, an MoE block)."""
        if isinstance(meta_or_ctx, ForwardContext):
            return meta_or_ctx
        if meta_or_ctx is not None and meta_or_ctx.use_cache:
            raise ValueError("a pass that reads a KV pool needs a ForwardContext (the model runner builds it: "
                             "ModelRunner.context); an AttentionMetadata alone runs with use_cache=False")
        return cls(meta=meta_or_ctx)

    def kv_layer(self, index: int) -> tuple:
        """(k, v, k_scale, v_scale) of layer `index` in this pass's pool (scales None unless quantized)."""
        kv = self.kv
        return kv.k[index], kv.v[index], kv.k_scale[index], kv.v_scale[index]
