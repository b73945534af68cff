"""The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, SmolLM2), written out in torch.

transformers is used only for the config and the weight files; this file is the model.
Tokens of every sequence in the step are concatenated into one flat batch [T, hidden]:
matmuls see all of them at once, attention splits them per sequence (layers/attention.py).

The model holds weights only: each pass gets a ForwardContext (layers/context.py) from the model
runner with the KV pool, the attention backend, which kernels run the small ops, the step's LoRA
batch and the engine's plug-ins, and hands it down to every layer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.activation import silu_and_mul
from ..layers.attention import Attention, AttentionMetadata
from ..layers.context import ForwardContext, ModelParts, NO_PARTS
from ..layers.linear import Linear, linear
from ..layers.lora import add_delta
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..quant.linear import QuantizedLinear
from ..quant.rotate import rotate_blocks
from . import cpu_decode
from .config import ModelConfig
from .moe import SparseMoeBlock


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.index = index
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Mixtral / Qwen2-MoE layers: a sparse mixture of experts (models/moe.py) instead of the dense MLP
        self.moe = SparseMoeBlock(cfg, index) if cfg.is_moe_layer(index) else None
        if self.moe is None:
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
            self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.__dict__["rotary"] = rotary  # shared table, owned by the model (not a submodule here)
        # [b, b] Hadamard when down_proj's input is rotated within blocks of b channels (rotate_down_proj
        # in models/calibrate/rotate.py, weight_calibration="autoround"); None: not rotated
        self.register_buffer("down_rotation", None, persistent=False)

    def forward(self, positions, hidden, ctx: ForwardContext | AttentionMetadata) -> torch.Tensor:
        ctx = ForwardContext.of(ctx)
        hidden = hidden + self.attention(positions, self.input_layernorm(hidden), ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), ctx)

    def forward_fused(self, positions, delta, residual, ctx: ForwardContext):
        """The same layer with each residual add fused into the norm after it (the Triton / CPU kernels).

        The layer's input is residual + delta (delta None for the first layer); returns
        (delta, residual) whose sum is its output. `residual` is updated in place.
        """
        x, residual = self.input_layernorm.add_and_norm(delta, residual, ctx.ops)
        x, residual = self.post_attention_layernorm.add_and_norm(self.attention(positions, x, ctx), residual, ctx.ops)
        return self.mlp(x, ctx), residual

    def project(self, name: str, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One of the fused projections (qkv_proj, o_proj, gate_up_proj, down_proj) with the pass's plug-ins:
        the engine's quantized matmul on a quantized layer of its format, then the step's LoRA deltas."""
        module = self._modules[name]
        matmul = ctx.parts.matmul_for(module) if isinstance(module, QuantizedLinear) else None
        y = module(x) if matmul is None else module(x, matmul)
        return add_delta(x, y, ctx.lora, self.index, name, ctx.parts.lora_delta)

    def attention(self, positions, x, ctx: ForwardContext | AttentionMetadata) -> torch.Tensor:
        """Normed hidden [T, hidden] -> o_proj(attention) [T, hidden]."""
        ctx = ForwardContext.of(ctx)
        num_tokens = x.shape[0]
        cfg = self.cfg
        qkv = self.project("qkv_proj", x, ctx)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotary(positions, q, k, ctx.ops)
        return self.project("o_proj", self.attn(q, k, v, ctx).reshape(num_tokens, self.q_size), ctx)

    def mlp(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        ctx = ForwardContext.of(ctx)
        if self.moe is not None:
            return self.moe(x, ctx)
        act = silu_and_mul(self.project("gate_up_proj", x, ctx), ctx.ops)
        return self.project("down_proj", self.down_input(act), ctx)

    def lora_slices(self) -> dict[str, tuple[int, list[tuple[str, int, int]]]]:
        """The fused linear layers LoRA adapters act on (layers/lora.py): attribute -> (in_features,
        [(PEFT module name, first output column, width)]): q|k|v and gate|up share one matmul each."""
        cfg, q, kv, inter = self.cfg, self.q_size, self.kv_size, self.cfg.intermediate_size
        slices = {"qkv_proj": (cfg.hidden_size, [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]),
                  "o_proj": (q, [("o_proj", 0, cfg.hidden_size)])}
        if "gate_up_proj" in self._modules:   # a dense MLP (a mixture-of-experts layer has none)
            slices["gate_up_proj"] = (cfg.hidden_size, [("gate_proj", 0, inter), ("up_proj", inter, inter)])
            slices["down_proj"] = (inter, [("down_proj", 0, cfg.hidden_size)])
        return slices

    def down_input(self, act: torch.Tensor) -> torch.Tensor:
        """SiLU-and-mul's output [T, intermediate] as down_proj takes it: rotated block by block when
        down_proj's weight was (quant/rotate.py), else as it is."""
        return act if self.down_rotation is None else rotate_blocks(act, self.down_rotation)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.rotary = rotary
        self.layers = nn.ModuleList([DecoderLayer(cfg, rotary, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        # weight_dtype lever: the head as a QuantizedLinear (set by models/quantize.py). A tied
        # embedding is then dropped (embed_tokens None) and looked up in the head's storage.
        self.quantized_head = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.quantized_head is not None:  # a dequantized copy: what the quantized head multiplies by
            return self.quantized_head.dequantized_weight()
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | AttentionMetadata,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (before lm_head).

        ctx: the pass's ForwardContext (the model runner's), or the AttentionMetadata of a pass without a
        KV pool (use_cache=False; the torch reference everywhere). num_layers: run only the first layers,
        then the final norm (an early exit: the "self" speculative proposer drafts with it; their K/V are
        the full model's for those layers)."""
        ctx = ForwardContext.of(ctx)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        hidden = self.embed(input_ids)
        if ctx.ops == "cpu" and ctx.cpu_plans is not None:   # a decode step's layers in one C call, when it covers them
            fused = cpu_decode.run(self, layers, positions, hidden, ctx, DecoderLayer)
            if fused is not None:
                return self.norm.add_and_norm(*fused, ctx.ops)[0]
        if ctx.ops != "torch":  # the residual stream is carried apart, added inside each norm
            delta = None
            for layer in layers:
                delta, hidden = layer.forward_fused(positions, delta, hidden, ctx)
            return self.norm.add_and_norm(delta, hidden, ctx.ops)[0]
        for layer in layers:
            hidden = layer(positions, hidden, ctx)
        return self.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the embedding table's rows, or the quantized tied head's (dequantized)."""
        if self.embed_tokens is None:
            return self.quantized_head.rows(input_ids)
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, parts: ModelParts = NO_PARTS) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab] (parts: the engine's plug-ins; a quantized head of the plugged
        matmul's format runs it too)."""
        if self.quantized_head is not None:
            return self.quantized_head(hidden, parts.matmul_for(self.quantized_head)).float()
        return linear(hidden, self.lm_head_weight).float()
