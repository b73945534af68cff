"""build_engine: the one place an Engine gets its parts.

    device, dtype      resolve_device / resolve_dtype (hardware.py), check_cuda_graphs; the config resolved for
                       the device (chunked prefill on with the KV cache, its budget per device: config.py)
    context            context_limit: max_model_len within the model's positions and sliding window
    weights            load_weights: from disk, or shared with (or quantized from) another engine's
    KV pool            build_kv_pool: bytes -> blocks (kv_cache.pool_bytes), the block allocator, the cache
    parts              EngineParts: the replaceable ones (minillm/seams.py), each checked against its
                       protocol before anything is loaded; None takes the engine's own
    speculation        build_speculator: the proposer and verifier of speculative=...
    tensor parallelism tensor_parallel_size > 1: this process is rank 0 (its shard, its heads' KV pool, a runner
                       that broadcasts each forward); the other ranks start here (engine/parallel.py)

`LLM(...)` and `llm.with_levers(...)` call build_engine; labs pass their parts through them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial

import torch

from ..config import EngineConfig
from ..hardware import resolve_device, resolve_dtype
from ..layers.lora import layer_shapes
from ..lora import LoRARegistry
from ..models.loader import load_model, load_model_config, load_tokenizer, read_generation_eos, resolve_model_path
from ..models.quantize import head_dtype_for, quantize_for_config
from ..layers.context import ModelParts
from ..models.moe import check_moe_parts
from ..seams import (BlockAllocator, LoRADelta, MoEExperts, MoERouter, PrefixCache, Proposer, QuantizedMatmul, Sampler,
                     SchedulingPolicy, TensorSharding, Truncation, Verifier, check_part)
from ..speculative.draft import DraftModelProposer, SelfDraftProposer
from ..speculative.ngram import NgramProposer
from ..speculative.verify import SpecVerifier
from .block_manager import BlockManager
from .engine import Engine, Weights
from .kv_cache import KVCache, kv_bytes_per_token, pool_bytes
from .metrics import SpecStats
from .model_runner import ModelRunner
from .parallel import TensorParallel, TPKVCache, TPModelRunner, check_config, tensor_parallel_weights
from .scheduler import Scheduler
from .speculator import PROPOSERS, DraftWorker, Speculator

BlockManagerFactory = Callable[[int, int, bool], BlockAllocator]   # (num_blocks, block_size, contiguous)


@dataclass
class EngineParts:
    """The parts a lab (or a later lever) replaces; None: the engine's own. Protocols in minillm/seams.py.

    block_manager      a factory (num_blocks, block_size, contiguous) -> BlockAllocator, called once the
                       pool is sized (BlockManager itself is one)
    scheduling_policy  a SchedulingPolicy (default: from batching=)
    proposer           a Proposer (needs speculative=; default: the method's own)
    verifier           a Verifier (needs speculative=; default: greedy_verify / rejection_sample)
    sampler            a Sampler (default: TorchSampler)
    quantized_matmul   a QuantizedMatmul (needs weight_dtype=; default: each quantized layer's own path)
    lora_delta         a LoRADelta (needs enable_lora=True; default: add_lora_delta, torch or Triton SGMV)
    moe_router         a MoERouter (a Mixtral-style model; default: softmax, top-k, renormalised)
    moe_experts        a MoEExperts (a Mixtral-style model; default: the experts' loop or the fused-MoE kernel)
    sharding           a TensorSharding (needs tensor_parallel_size > 1; default: MegatronSharding, models/shard.py):
                       every rank cuts its shard with it and runs its row-parallel matmuls through it

    quantized_matmul .. moe_experts act inside the model: the runner hands them to it in each pass's ForwardContext.
    """

    block_manager: BlockManagerFactory | None = None
    scheduling_policy: SchedulingPolicy | None = None
    proposer: Proposer | None = None
    verifier: Verifier | None = None
    sampler: Sampler | None = None
    quantized_matmul: QuantizedMatmul | None = None
    lora_delta: LoRADelta | None = None
    moe_router: MoERouter | None = None
    moe_experts: MoEExperts | None = None
    sharding: TensorSharding | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def check(self, config: EngineConfig) -> "EngineParts":
        """Refuse a part that misses a method of its protocol, or that the levers leave unused."""
        if self.scheduling_policy is not None:
            check_part(self.scheduling_policy, SchedulingPolicy, "scheduling_policy")
        if self.sampler is not None:
            check_part(self.sampler, Sampler, "sampler")
        for name, part, protocol in (("proposer", self.proposer, Proposer), ("verifier", self.verifier, Verifier)):
            if part is None:
                continue
            if config.speculative is None:
                raise ValueError(f"{name}={type(part).__name__} needs speculative= (one of {PROPOSERS}): "
                                 "without it the engine never speculates")
            check_part(part, protocol, name)
        if self.quantized_matmul is not None:
            if config.weight_dtype in (None, "auto"):
                raise ValueError("quantized_matmul= needs weight_dtype= ('int8', 'int4' or 'fp8'): with the model's "
                                 "own dtype there is no quantized layer to run it")
            if config.tensor_parallel_size > 1:
                raise ValueError(f"quantized_matmul= with tensor_parallel_size={config.tensor_parallel_size}: the "
                                 "worker processes keep their built-in matmuls; plug it into a tensor_parallel_size=1 "
                                 "engine")
            check_part(self.quantized_matmul, QuantizedMatmul, "quantized_matmul")
        if self.lora_delta is not None:
            if not config.enable_lora:
                raise ValueError("lora_delta= needs enable_lora=True: without adapters there is no delta to add")
            check_part(self.lora_delta, LoRADelta, "lora_delta")
        for name, part, protocol in (("moe_router", self.moe_router, MoERouter),
                                     ("moe_experts", self.moe_experts, MoEExperts)):
            if part is not None:
                check_part(part, protocol, name)
        if self.sharding is not None:
            if config.tensor_parallel_size == 1:
                raise ValueError("sharding= needs tensor_parallel_size > 1 (2 or more ranks): with one rank nothing is "
                                 "cut and there is nothing to all-reduce")
            check_part(self.sharding, TensorSharding, "sharding")
        if self.block_manager is not None:
            if not config.kv_cache:
                raise ValueError("block_manager= needs kv_cache=True: without a cache there is no pool to manage")
            if not callable(self.block_manager):
                raise TypeError(f"block_manager={self.block_manager!r} must be a factory "
                                "(num_blocks, block_size, contiguous) -> BlockAllocator, e.g. BlockManager")
        return self

    def model_parts(self, config: EngineConfig) -> ModelParts:
        """The parts that act inside the model, as the runner hands them to it."""
        return ModelParts(self.quantized_matmul, config.weight_dtype if self.quantized_matmul is not None else None,
                          self.lora_delta, self.moe_router, self.moe_experts)


def check_cuda_graphs(config: EngineConfig, device: torch.device) -> None:
    if config.cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, but this engine runs on {device.type!r} "
                         f"(device={config.device!r}); CUDA graphs replay GPU kernel launches. "
                         "Leave cuda_graphs=False on this machine.")


def context_limit(config: EngineConfig, model_config) -> int:
    """max_model_len, or the model's context; sequences stay inside a sliding window (full attention
    is exact there)."""
    limit = model_config.max_position_embeddings
    if model_config.sliding_window:
        limit = min(limit, model_config.sliding_window)
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {limit} tokens")
    return config.max_model_len or limit


def weight_format(config: EngineConfig) -> tuple:
    """What distinguishes two engines' weights: (weight_dtype, group size, calibration, head dtype)."""
    wd = config.weight_dtype if config.weight_dtype != "auto" else None
    return (wd, config.weight_group_size if wd == "int4" else None, config.weight_calibration if wd else None,
            head_dtype_for(wd, config.weight_head_dtype) if wd else None)


def load_weights(config: EngineConfig, model_path: str, model_config, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, donor: Engine | None = None) -> Weights:
    """The model and tokenizer: a donor engine's own when they match (same device, dtype, format and a
    context at least as long), its float weights quantized in memory (a shallow copy) when only the
    format differs, else loaded from disk (and quantized in place)."""
    fmt = weight_format(config)
    wd = fmt[0]
    compatible = donor is not None and (donor.device, donor.dtype) == (device, dtype) \
        and donor.max_model_len >= max_model_len
    if compatible and donor.weights.format == fmt:
        model, tokenizer = donor.model, donor.tokenizer
    elif compatible and donor.weights.format[0] is None:
        tokenizer = donor.tokenizer
        model = quantize_for_config(donor.model, wd, config.weight_group_size, config.weight_calibration, tokenizer,
                                    in_place=False, head_dtype=config.weight_head_dtype)
    else:
        model = load_model(model_path, dtype, device, max_model_len)
        tokenizer = load_tokenizer(model_path)
        if wd is not None:
            quantize_for_config(model, wd, config.weight_group_size, config.weight_calibration, tokenizer,
                                in_place=True, head_dtype=config.weight_head_dtype)
    return make_weights(model_path, model_config, model, tokenizer, fmt)


def make_weights(model_path: str, model_config, model, tokenizer, fmt: tuple) -> Weights:
    """Weights with the EOS ids of config.json, generation_config.json and the tokenizer."""
    eos = set(model_config.eos_token_ids) | set(read_generation_eos(model_path))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return Weights(model_path, model_config, model, tokenizer, fmt, eos)


def build_kv_pool(config: EngineConfig, model_config, dtype: torch.dtype, device: torch.device, max_model_len: int,
                  factory: BlockManagerFactory | None = None, cache_class: Callable[..., KVCache] = KVCache,
                  cache_config=None) -> tuple[BlockAllocator | None, KVCache | None]:
    """The block allocator and the KV cache (None, None with kv_cache=False). The pool's bytes
    (kv_cache_bytes, kv_cache_memory_fraction, or enough for the batch) become whole blocks.
    cache_config: the shapes the pool stores (tensor parallelism: one rank's heads; the blocks are
    counted with the whole model's, so every rank has as many as one unsharded pool)."""
    if not config.kv_cache:
        return None, None
    size = pool_bytes(model_config, dtype, device, config.max_num_seqs, max_model_len, config.kv_cache_bytes,
                      config.kv_cache_memory_fraction, config.kv_dtype)
    per_block = kv_bytes_per_token(model_config, dtype, config.kv_dtype) * config.block_size
    num_blocks = size // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV pool of {size} bytes holds no block of {per_block} bytes; "
                         "raise kv_cache_bytes or kv_cache_memory_fraction")
    if not config.paged and num_blocks * config.block_size < max_model_len:
        raise ValueError(
            f"paged=False reserves max_model_len={max_model_len} tokens per request, but the KV pool "
            f"of {size} bytes holds {num_blocks * config.block_size} tokens; lower max_model_len, raise "
            "kv_cache_bytes, or use paged=True")
    block_manager = (factory or BlockManager)(num_blocks, config.block_size, not config.paged)
    needs = [BlockAllocator]
    if config.prefix_caching and config.paged:
        needs.append(PrefixCache)
    if config.speculative is not None:
        needs.append(Truncation)
    check_part(block_manager, needs, "block_manager")
    kv_cache = cache_class(cache_config or model_config, num_blocks, config.block_size, dtype, device, config.kv_dtype)
    kv_cache.bytes_per_token = kv_bytes_per_token(model_config, dtype, config.kv_dtype)   # all ranks together
    return block_manager, kv_cache


def load_draft(config: EngineConfig, weights: Weights, device: torch.device, dtype: torch.dtype, max_model_len: int,
               block_manager: BlockAllocator) -> DraftWorker:
    """speculative="draft": the second model, on this engine's device and dtype, with a KV pool of as
    many blocks as the target's. It must share the target's tokenizer (same vocabulary: a proposal is
    a token id the target scores) and cover max_model_len positions."""
    path = resolve_model_path(config.draft_model)
    dcfg = load_model_config(path)
    vocab = weights.model_config.vocab_size
    if dcfg.vocab_size != vocab:
        raise ValueError(f"draft_model={config.draft_model!r} has a vocabulary of {dcfg.vocab_size} tokens, the "
                         f"target {vocab}: the draft must share the target's tokenizer")
    if dcfg.max_position_embeddings < max_model_len:
        raise ValueError(f"draft_model={config.draft_model!r} has a context of {dcfg.max_position_embeddings} "
                         f"tokens, shorter than max_model_len={max_model_len}; lower max_model_len")
    if weights.tokenizer is not None:
        draft_tokenizer = load_tokenizer(path)
        if draft_tokenizer is not None and draft_tokenizer.get_vocab() != weights.tokenizer.get_vocab():
            raise ValueError(f"draft_model={config.draft_model!r} has another tokenizer than the target "
                             "(same size, different tokens): its proposals would mean other text")
    model = load_model(path, dtype, device, max_model_len)
    return DraftWorker(model, dcfg, device, dtype, block_manager.num_blocks, block_manager.block_size,
                       config.attention_backend)


def build_speculator(config: EngineConfig, parts: EngineParts, runner: ModelRunner, block_manager, max_model_len: int,
                     draft: DraftWorker | None, stats: Callable[[], SpecStats]) -> Speculator | None:
    """speculative=...: the method's proposer (or parts.proposer) and the verifier; stats(): the engine's
    counters of the current run (the Engine passes them when it calls this)."""
    method = config.speculative
    if method is None:
        return None
    if method not in PROPOSERS:
        raise ValueError(f"speculative={method!r} is not one of {PROPOSERS}")
    proposer = parts.proposer
    if proposer is None and method == "ngram":
        proposer = NgramProposer()
    elif proposer is None and method == "self":
        num_layers = len(runner.model.layers)
        draft_num_layers = config.draft_num_layers or max(1, num_layers // 4)
        if not 1 <= draft_num_layers < num_layers:
            raise ValueError(f"draft_num_layers={draft_num_layers} must be in [1, {num_layers - 1}]: the draft is "
                             f"the first layers of this {num_layers}-layer model")
        proposer = SelfDraftProposer(runner, draft_num_layers, stats)
    elif proposer is None:
        proposer = DraftModelProposer(draft, stats, runner)
    verifier = parts.verifier if parts.verifier is not None else SpecVerifier()
    return Speculator(config.num_speculative_tokens, runner, block_manager, max_model_len, proposer, verifier, stats)


def build_engine(config: EngineConfig, parts: EngineParts | None = None,
                 share_weights_with: Engine | None = None) -> Engine:
    """An Engine for `config`, with `parts` replacing the engine's own; `share_weights_with`: another
    engine whose weights this one reuses (LLM.with_levers) instead of loading them again."""
    parts = (parts or EngineParts()).check(config)
    device = resolve_device(config.device)
    config.resolve_defaults(device)   # chunked prefill and its budget per device (config.py), in place
    dtype = resolve_dtype(config.dtype, device)
    check_cuda_graphs(config, device)
    donor = share_weights_with
    model_path = donor.model_path if donor is not None else resolve_model_path(config.model)
    model_config = load_model_config(model_path)
    max_model_len = context_limit(config, model_config)
    tp = None
    if config.tensor_parallel_size > 1 or (donor is not None and donor.tensor_parallel is not None):
        donor = None   # a shard is never shared with another engine: each tensor-parallel engine cuts its own
    if config.tensor_parallel_size == 1:
        weights = load_weights(config, model_path, model_config, device, dtype, max_model_len, donor)
        block_manager, kv_cache = build_kv_pool(config, model_config, dtype, device, max_model_len,
                                                parts.block_manager)
    else:
        check_config(config, model_config, device, parts.sharding)
        tp = TensorParallel(config.tensor_parallel_size, device)
        block_manager, kv_cache = build_kv_pool(config, model_config, dtype, device, max_model_len, parts.block_manager,
                                                partial(TPKVCache, tp), tp.shard_config(model_config))
        model = tensor_parallel_weights(tp, config, model_path, device, dtype, max_model_len,
                                        block_manager.num_blocks if block_manager is not None else 0, parts.sharding)
        weights = make_weights(model_path, model_config, model, load_tokenizer(model_path), weight_format(config))
    check_moe_parts(weights.model, parts.moe_router, parts.moe_experts)
    scheduler = Scheduler(config, block_manager, max_model_len, parts.scheduling_policy)
    runner = (partial(TPModelRunner, tp) if tp else ModelRunner)(
        weights.model, device, block_manager, kv_cache, config.attention_backend, parts.sampler,
        parts.model_parts(config), tuple(sorted(weights.eos_token_ids)))
    if config.cuda_graphs:
        runner.enable_cuda_graphs(config.max_num_seqs, max_model_len)
    lora_registry = None
    if config.enable_lora:   # adapters are read at their first request, into max_loras slots
        lora_registry = LoRARegistry(layer_shapes(weights.model), config.max_lora_rank, dtype)
        runner.enable_lora(lora_registry, config.max_loras, config.max_lora_rank, dtype)
    draft = None
    if config.speculative == "draft" and parts.proposer is None:
        draft = load_draft(config, weights, device, dtype, max_model_len, block_manager)
    return Engine(config, device, dtype, weights, max_model_len, block_manager, kv_cache, scheduler, runner,
                  parts=parts, draft=draft, lora_registry=lora_registry, tensor_parallel=tp,
                  speculator_factory=partial(build_speculator, config, parts, runner, block_manager, max_model_len,
                                             draft))
