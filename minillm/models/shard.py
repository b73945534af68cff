"""Shard a loaded Llama-family model for tensor parallelism: this rank's heads, MLP slice and vocabulary.

Megatron's split, rank r of N (layers/parallel.py does the communication):

    qkv_proj      column-parallel: the rows of this rank's num_heads/N query heads and num_kv_heads/N KV heads
    o_proj        row-parallel: the input columns of those query heads; all-reduce; bias added once after it
    gate_up_proj  column-parallel: rows [r I/N, (r+1) I/N) of gate and the same of up
    down_proj     row-parallel: input columns [r I/N, (r+1) I/N); all-reduce; bias after it
    embedding     vocabulary rows [r S, (r+1) S), S = ceil(vocab / N) (the last shard zero-padded): a lookup
                  outside them reads zeros, an all-reduce fills every row in
    head          the same vocabulary rows; each rank's logits all-gathered, the padding cut off
    norms, rotary replicated

Query head j attends with KV head j // (num_heads / num_kv_heads), so rank r's query heads use exactly
rank r's KV heads: each rank's KV cache holds its heads only. Heads must divide evenly: N divides both
num_heads and num_kv_heads (KV heads are not replicated when N > num_kv_heads; such an N is refused).

Quantized weights (weight_dtype) are quantized after sharding, shard by shard, so that every rank's
values equal the unsharded model's: per-output-row formats (int8, fp8) are unchanged by a row split and
a row-parallel shard keeps the whole row's scale (quantized over the full row, then its columns cut);
int4 groups run along the input columns, so the group size must divide each row-parallel shard's width
(then the groups are the unsharded model's groups).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..layers.context import NO_PARTS, ModelParts
from ..layers.linear import Linear
from ..layers.parallel import RowParallelLinear, TPGroup, vocab_parallel_lookup
from ..quant.linear import ChannelLinear
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .quantize import HEAD_INT4_GROUP_SIZE, head_dtype_for, quantize_model


def allowed_sizes(cfg: ModelConfig) -> list[int]:
    """Every tensor_parallel_size this model can be split by: divisors of both head counts and the MLP width."""
    top = math.gcd(cfg.num_heads, cfg.num_kv_heads)
    return [n for n in range(1, top + 1) if top % n == 0 and cfg.intermediate_size % n == 0]


def check_tensor_parallel(cfg: ModelConfig, world_size: int, weight_dtype: str | None = None,
                          group_size: int = 128) -> None:
    """ValueError naming the head counts and the allowed sizes when `world_size` cannot split `cfg`."""
    if world_size == 1:
        return
    if cfg.num_experts:
        raise ValueError(f"tensor_parallel_size={world_size}: mixture-of-experts models ({cfg.model_type}) are not "
                         "sharded yet (their experts are not split); use tensor_parallel_size=1")
    allowed = allowed_sizes(cfg)
    if world_size not in allowed:
        raise ValueError(
            f"tensor_parallel_size={world_size} does not split this model evenly: it has {cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads and an MLP of {cfg.intermediate_size}, and each rank takes an equal share "
            f"of each (KV heads are not replicated); allowed: {allowed}")
    if weight_dtype == "int4":
        widths = {"o_proj": cfg.num_heads // world_size * cfg.head_dim,
                  "down_proj": cfg.intermediate_size // world_size}
        bad = {name: width for name, width in widths.items() if width % group_size}
        if bad:
            fits = [g for g in (32, 64, 128) if all(w % g == 0 for w in widths.values())]
            raise ValueError(
                f"weight_dtype='int4' with tensor_parallel_size={world_size}: weight_group_size={group_size} does not "
                f"divide the input columns each rank holds of {', '.join(f'{k} ({v})' for k, v in bad.items())}; "
                "int4 groups must not straddle two ranks. " + (f"Use weight_group_size in {fits}" if fits else
                                                                "No group size fits: use weight_dtype='int8'"))


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's shapes: num_heads / N, num_kv_heads / N, intermediate_size / N, ceil(vocab / N) rows."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world_size, num_kv_heads=cfg.num_kv_heads // world_size,
                               intermediate_size=cfg.intermediate_size // world_size,
                               vocab_size=-(-cfg.vocab_size // world_size))


class ShardedLlama(LlamaForCausalLM):
    """LlamaForCausalLM over one rank's shard: the embedding and the head are vocabulary-parallel.
    `before_head(hidden)`: called before the head's all-gather (rank 0's engine tells the other ranks
    to run their slice of the head on the same rows)."""

    def __init__(self, shard_cfg: ModelConfig, full_cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
                 group: TPGroup):
        super().__init__(shard_cfg, max_positions, dtype)
        self.full_cfg = full_cfg
        self.__dict__["group"] = group
        self.vocab_start = group.rank * shard_cfg.vocab_size
        self.vocab_end = min(self.vocab_start + shard_cfg.vocab_size, full_cfg.vocab_size)
        self.before_head = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(super().embed, input_ids, self.vocab_start, self.vocab_end, self.group)

    def compute_logits(self, hidden: torch.Tensor, parts: ModelParts = NO_PARTS) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab], the whole vocabulary on every rank."""
        if self.before_head is not None:
            self.before_head(hidden)
        local = super().compute_logits(hidden, parts)
        return self.group.all_gather_last(local)[..., :self.full_cfg.vocab_size]


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t[start:start + size]


class MegatronSharding:
    """The engine's own TensorSharding (seams.py): contiguous blocks, rank 0 first; the partial product of a
    row-parallel layer, then the all-reduce."""

    def column(self, weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        size = weight.shape[0] // world_size
        return weight[rank * size:(rank + 1) * size]

    def row(self, weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        size = weight.shape[1] // world_size
        return weight[:, rank * size:(rank + 1) * size]

    def row_matmul(self, x: torch.Tensor, weight: torch.Tensor, all_reduce) -> torch.Tensor:
        return all_reduce((x @ weight.t()).contiguous())


def _cut(sharding, how: str, weight: torch.Tensor, rank: int, world_size: int, what: str) -> torch.Tensor:
    """sharding.column / sharding.row on one matrix, its shape checked (a bias is cut as a [out, 1] matrix)."""
    vector = weight.dim() == 1
    full = weight.detach().clone().unsqueeze(1) if vector else weight.detach().clone()
    out_f, in_f = full.shape
    want = (out_f // world_size, in_f) if how == "column" else (out_f, in_f // world_size)
    got = (sharding.column if how == "column" else sharding.row)(full, rank, world_size)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != want:
        other = "column" if how == "row" else "row"
        hint = (f" (that is the shape {other}() should give: {how}() cuts dim {0 if how == 'column' else 1})"
                if isinstance(got, torch.Tensor) and tuple(got.shape) == ((out_f, in_f // world_size) if how == "column"
                                                                           else (out_f // world_size, in_f)) else "")
        raise ValueError(f"sharding.{how}({what} [{out_f}, {in_f}], rank={rank}, world_size={world_size}) returned "
                         f"{list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}; expected "
                         f"{list(want)}{hint}")
    got = got.to(weight.dtype).contiguous()
    return got[:, 0] if vector else got


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, group: TPGroup, weight_dtype: str | None = None, group_size: int = 128,
                weight_head_dtype: str = "auto", sharding=None) -> ShardedLlama:
    """Rank group.rank's shard of a float `model` (left as it was), quantized to weight_dtype (None: float).
    `sharding`: a TensorSharding (seams.py) that cuts the decoder layers' matrices and runs the row-parallel
    layers' matmul and all-reduce (float weights only); None: the engine's own cut."""
    cfg, n, r = model.cfg, group.world_size, group.rank
    check_tensor_parallel(cfg, n, weight_dtype, group_size)
    if sharding is not None and weight_dtype not in (None, "auto"):
        raise ValueError(f"sharding= with weight_dtype={weight_dtype!r}: a sharding part cuts float weights; "
                         "leave weight_dtype unset")
    if model.quantized_head is not None or any(not isinstance(layer.o_proj, Linear) for layer in model.layers):
        raise ValueError("shard_model takes a float model: shard first, then quantize the shards")
    scfg = shard_config(cfg, n)
    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    max_positions = model.rotary.args[1]
    with torch.device("meta"):
        shard = ShardedLlama(scfg, cfg, max_positions, dtype, group)
    shard = shard.to(dtype=dtype).to_empty(device=device)
    shard.rotary.build(device)
    hd = cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    sq, skv, si = scfg.num_heads * hd, scfg.num_kv_heads * hd, scfg.intermediate_size
    qkv_rows = torch.cat([torch.arange(r * sq, (r + 1) * sq), q + torch.arange(r * skv, (r + 1) * skv),
                          q + kv + torch.arange(r * skv, (r + 1) * skv)]).to(device)
    gate_up_rows = torch.cat([torch.arange(r * si, (r + 1) * si),
                              cfg.intermediate_size + torch.arange(r * si, (r + 1) * si)]).to(device)
    row_biases = []

    def column_cut(t: torch.Tensor, rows: torch.Tensor, sizes: tuple[int, ...], what: str) -> torch.Tensor:
        if sharding is None:
            return t[rows]
        return torch.cat([_cut(sharding, "column", part, r, n, f"{what}[{name}]")
                          for part, name in zip(t.split(sizes), ("q", "k", "v") if len(sizes) == 3 else ("gate", "up"))])

    def row_cut(t: torch.Tensor, start: int, width: int, what: str) -> torch.Tensor:
        if sharding is None:
            return t[:, start:start + width].contiguous()
        return _cut(sharding, "row", t, r, n, what)

    qkv_sizes, gate_up_sizes = (q, kv, kv), (cfg.intermediate_size,) * 2
    for full, mine in zip(model.layers, shard.layers):
        mine.input_layernorm.weight.copy_(full.input_layernorm.weight)
        mine.post_attention_layernorm.weight.copy_(full.post_attention_layernorm.weight)
        mine.qkv_proj.weight.copy_(column_cut(full.qkv_proj.weight, qkv_rows, qkv_sizes, "qkv_proj.weight"))
        if full.qkv_proj.bias is not None:
            mine.qkv_proj.bias.copy_(column_cut(full.qkv_proj.bias, qkv_rows, qkv_sizes, "qkv_proj.bias"))
        mine.gate_up_proj.weight.copy_(column_cut(full.gate_up_proj.weight, gate_up_rows, gate_up_sizes,
                                                  "gate_up_proj.weight"))
        if full.gate_up_proj.bias is not None:
            mine.gate_up_proj.bias.copy_(column_cut(full.gate_up_proj.bias, gate_up_rows, gate_up_sizes,
                                                    "gate_up_proj.bias"))
        # row-parallel: this rank's input columns, no bias inside (added once, after the all-reduce)
        mine.o_proj = Linear(sq, cfg.hidden_size)
        mine.o_proj.weight.data = row_cut(full.o_proj.weight, r * sq, sq, "o_proj.weight")
        mine.down_proj = Linear(si, cfg.hidden_size)
        mine.down_proj.weight.data = row_cut(full.down_proj.weight, r * si, si, "down_proj.weight")
        row_biases.append((full.o_proj.bias, full.down_proj.bias))
    shard.norm.weight.copy_(model.norm.weight)
    lo, hi = shard.vocab_start, shard.vocab_end
    shard.embed_tokens.weight.zero_()
    shard.embed_tokens.weight[:hi - lo].copy_(model.embed_tokens.weight[lo:hi])
    if shard.lm_head is not None:
        shard.lm_head.weight.zero_()
        shard.lm_head.weight[:hi - lo].copy_(model.lm_head.weight[lo:hi])
    if weight_dtype not in (None, "auto"):
        head = head_dtype_for(weight_dtype, weight_head_dtype)
        quantize_model(shard, weight_dtype, group_size, head_dtype=head,
                       head_group_size=HEAD_INT4_GROUP_SIZE if head == "int4" else None)
        for full, mine in zip(model.layers, shard.layers):
            for name, width in (("o_proj", sq), ("down_proj", si)):
                _whole_row_scales(getattr(mine, name), getattr(full, name).weight, r * width, width)
    row_matmul = sharding.row_matmul if sharding is not None else None
    for mine, (o_bias, down_bias) in zip(shard.layers, row_biases):
        mine.o_proj = RowParallelLinear(mine.o_proj, o_bias, group, row_matmul)
        mine.down_proj = RowParallelLinear(mine.down_proj, down_bias, group, row_matmul)
    shard.eval()
    return shard


def _whole_row_scales(layer, full_weight: torch.Tensor, start: int, width: int) -> None:
    """A row-parallel shard of a per-output-row format (int8, fp8): quantize the whole rows (their scales
    are the unsharded model's), keep this rank's columns. int4's groups are already the unsharded ones."""
    if not isinstance(layer, ChannelLinear):
        return
    q, scale = layer.quantize(layer.float_weight(full_weight, None))
    layer.q = q[:, start:start + width].contiguous()
    layer.scale = scale.to(layer.scale.dtype)
