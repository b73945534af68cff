"""ModelConfig: the few numbers of a Llama-family checkpoint that the forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (Mixtral, Qwen2-MoE; models/moe.py). num_experts 0: every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0          # top-k experts per token
    moe_intermediate_size: int = 0        # each expert's intermediate width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    norm_topk_prob: bool = True           # renormalise the top-k probabilities to sum to 1 (Mixtral: always)
    decoder_sparse_step: int = 1          # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = () # ... and i is not listed here (Qwen2-MoE)

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has a sparse MoE block (else a dense MLP of intermediate_size)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def moe_layer_params(self, num_experts: int | None = None) -> int:
        """Parameters of one MoE block with `num_experts` of its experts (None: all): router, experts,
        shared expert and its gate."""
        h, e = self.hidden_size, self.num_experts if num_experts is None else num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return self.num_experts * h + e * 3 * h * self.moe_intermediate_size + shared

    @property
    def num_active_params(self) -> int:
        """Parameters one token multiplies by: num_params with only top-k experts per MoE layer."""
        saved = self.moe_layer_params() - self.moe_layer_params(self.num_experts_per_tok)
        return self.num_params - self.num_moe_layers * saved

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        mlp = 3 * h * i
        if self.mlp_bias:
            mlp += 2 * i + h
        moe_layers = self.num_moe_layers
        per_layer = attn + 2 * h
        mlps = (self.num_layers - moe_layers) * mlp + moe_layers * self.moe_layer_params()
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + mlps + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; minillm runs the Llama family: {SUPPORTED_MODEL_TYPES}"
            )
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported (Llama family uses 'silu')")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling.
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        rope_theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
        scaling = dict(getattr(hf, "rope_scaling", None) or {}) or rope
        scaling.pop("rope_theta", None)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        use_sliding = getattr(hf, "use_sliding_window", model_type in ("mistral", "mixtral"))
        sliding = getattr(hf, "sliding_window", None) if use_sliding else None
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.qkv_bias)),
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            **_moe_fields(hf, model_type),
        )


def _moe_fields(hf: Any, model_type: str) -> dict:
    """The MoE fields of a Mixtral / Qwen2-MoE config ({} for dense families); what minillm does not run
    is refused by name."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    if model_type == "mixtral":
        num_experts, inter, shared, norm = hf.num_local_experts, hf.intermediate_size, 0, True
        step, mlp_only = 1, ()
    else:
        num_experts, inter = hf.num_experts, hf.moe_intermediate_size
        shared, norm = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0), bool(hf.norm_topk_prob)
        step, mlp_only = int(getattr(hf, "decoder_sparse_step", 1) or 1), tuple(getattr(hf, "mlp_only_layers", None) or ())
        if shared == 0:
            raise ValueError(f"{model_type}: shared_expert_intermediate_size=0 is not supported "
                             "(Qwen2-MoE always has a shared expert; transformers builds one of width 0)")
    top_k = int(hf.num_experts_per_tok)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"{model_type}: num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
    if step < 1:
        raise ValueError(f"{model_type}: decoder_sparse_step={step} must be >= 1")
    bad = [i for i in mlp_only if not 0 <= i < hf.num_hidden_layers]
    if bad:
        raise ValueError(f"{model_type}: mlp_only_layers={list(mlp_only)} has layers outside [0, {hf.num_hidden_layers})")
    return dict(num_experts=int(num_experts), num_experts_per_tok=top_k, moe_intermediate_size=int(inter),
                shared_expert_intermediate_size=shared, norm_topk_prob=norm, decoder_sparse_step=step,
                mlp_only_layers=mlp_only)
