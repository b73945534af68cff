"""ModelConfig: the few numbers of a Llama-family checkpoint that the forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
        per_layer = attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

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
        use_sliding = getattr(hf, "use_sliding_window", model_type == "mistral")
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
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
