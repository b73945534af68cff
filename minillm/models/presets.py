"""Model shapes without files: ModelConfig presets and random-weight models built on the device.

`LLM("random:llama-3-8b")` builds a Llama-3-8B-shaped model with random weights directly on
the target device in the target dtype (no 16 GB checkpoint to write or read) and no
tokenizer: prompts come as `{"prompt_token_ids": [...]}`. The GPU check script times real
shapes this way on a machine without network. The tokens mean nothing; the speed is real.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM

RANDOM_PREFIX = "random:"
INIT_STD = 0.02  # Hugging Face's initializer_range for Llama

_LLAMA = dict(model_type="llama", qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None)
_MIXTRAL = dict(_LLAMA, model_type="mixtral")
_QWEN2_MOE = dict(_LLAMA, model_type="qwen2_moe", qkv_bias=True)

PRESETS: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): the course's default model.
    "smollm2-135m": ModelConfig(
        **_LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    # meta-llama/Llama-3.1-8B(-Instruct): GQA 32:8, llama3 rope scaling, untied 128k vocab.
    "llama-3-8b": ModelConfig(
        **_LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    # Tiny shapes for tests and the CPU dry run (GQA 4:2, untied, llama3 rope scaling).
    "tiny-llama": ModelConfig(
        **_LLAMA, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,)),
    # Tensor-parallel tests: 8 query and 4 KV heads split by 2 or 4, an MLP of 128 (32 per rank at N = 4: one
    # int4 group of 32), and a vocabulary of 510 that 4 does not divide (the head's last shard is padded).
    "tiny-llama-tp": ModelConfig(
        **_LLAMA, vocab_size=510, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
        num_kv_heads=4, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,)),
    # A smaller model on tiny-llama's vocabulary: the draft of speculative="draft" in tests
    # (one layer, half the width, MQA: its KV pool has another shape than the target's).
    "tiny-llama-draft": ModelConfig(
        **_LLAMA, vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    # Mixture of experts (models/moe.py). mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active (top-2 of 8).
    "mixtral-8x7b": ModelConfig(
        **_MIXTRAL, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None,
        max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 routed experts (top-4, not renormalised) and a shared expert; 14.3B / 2.7B active.
    "qwen1.5-moe-a2.7b": ModelConfig(
        **_QWEN2_MOE, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_layers=24, num_heads=16,
        num_kv_heads=16, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=151643, eos_token_ids=(151643,),
        num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        norm_topk_prob=False),
    # Tiny MoE shapes for tests and the CPU: top-2 of 4 (GQA 4:2), top-1 of 8 (MQA, odd widths), and
    # Qwen2-MoE with a shared expert, un-renormalised top-2 of 6 and a dense second layer (mlp_only_layers).
    "tiny-mixtral": ModelConfig(
        **_MIXTRAL, vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96),
    "tiny-mixtral-top1": ModelConfig(
        **_MIXTRAL, vocab_size=512, hidden_size=48, intermediate_size=40, num_layers=3, num_heads=3, num_kv_heads=1,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        num_experts=8, num_experts_per_tok=1, moe_intermediate_size=40),
    "tiny-qwen2-moe": ModelConfig(
        **_QWEN2_MOE, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=80,
        norm_topk_prob=False, mlp_only_layers=(1,)),
}


def register_preset(name: str, cfg: ModelConfig) -> None:
    """Make `random:<name>` available (e.g. a preset with fewer layers)."""
    PRESETS[name] = cfg


def is_random(model: str | None) -> bool:
    return isinstance(model, str) and model.startswith(RANDOM_PREFIX)


def preset_config(model: str) -> ModelConfig:
    """'random:llama-3-8b' or 'llama-3-8b' -> its ModelConfig."""
    name = model[len(RANDOM_PREFIX):] if is_random(model) else model
    if name not in PRESETS:
        raise ValueError(f"model={model!r}: no preset {name!r}; the presets are {sorted(PRESETS)} "
                         f"(use '{RANDOM_PREFIX}<preset>')")
    return PRESETS[name]


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The equivalent transformers config's keyword arguments: `LlamaConfig(**...)` for the dense families,
    `AutoConfig.for_model(cfg.model_type, **...)` for any (Mixtral's and Qwen2-MoE's expert fields too)."""
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    moe = {}
    if cfg.model_type == "mixtral":
        moe = dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   intermediate_size=cfg.moe_intermediate_size)
    elif cfg.model_type == "qwen2_moe":
        moe = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                   decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                   qkv_bias=cfg.qkv_bias, attention_bias=False)
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias,
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
        rope_parameters=rope,  # transformers 5 (4.x took rope_theta / rope_scaling instead)
    ) | moe   # the MoE fields last: Mixtral's intermediate_size is its experts' width


def with_layers(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    return dataclasses.replace(cfg, num_layers=num_layers)


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 seed: int = 0) -> LlamaForCausalLM:
    """A LlamaForCausalLM of cfg's shapes, weights drawn on `device` in `dtype`:
    matrices and embeddings N(0, 0.02), norm weights 1, biases 0 (Hugging Face's init)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, dtype)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.rotary.build(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, INIT_STD, generator=gen)
    model.eval()
    return model
