"""The plug-in seams: every part of the engine a lab (or a later lever) replaces, as a protocol.

A part is any object with the methods of its protocol; nothing has to inherit from anything.
The engine checks each part once, when it is built (`check_part`), and refuses one that misses
a method with the missing name and the signature the protocol expects. After that the engine
calls the methods the protocol names and nothing else: it never probes a part with hasattr.

    part                protocol(s)                          passed as
    attention backend   SequenceAttention | PaddedDecodeAttention | BlockTableAttention
                                                             LLM(attention_backend=...)
    block allocator     BlockAllocator (+ PrefixCache with prefix_caching=True, + Truncation
                        with speculative=...; n > 1 shares a prompt's blocks only when it is also
                        Forking, else each continuation holds its own), built by a factory
                        (num_blocks, block_size, contiguous)
                                                             LLM(block_manager=...)
    scheduling policy   SchedulingPolicy                     LLM(scheduling_policy=...)
    proposer            Proposer (speculative=...)           LLM(proposer=...)
    verifier            Verifier (speculative=...)           LLM(verifier=...)
    sampler             Sampler                              LLM(sampler=...)
    quantized matmul    QuantizedMatmul (a function; weight_dtype=...)
                                                             LLM(quantized_matmul=...)
    LoRA delta          LoRADelta (a function; enable_lora=True) LLM(lora_delta=...)
    MoE routing         MoERouter (a function; a Mixtral-style model)
                                                             LLM(moe_router=...)
    MoE experts         MoEExperts (a function; a Mixtral-style model)
                                                             LLM(moe_experts=...)
    sharding            TensorSharding (tensor_parallel_size > 1) LLM(sharding=...)

A function part is any callable that takes its protocol's `__call__` arguments by position; it is checked
by binding them to its signature, so one with the wrong number of parameters is refused at construction
with the signature it should have. The model parts reach the model in each pass's ForwardContext
(layers/context.py): an engine keeps them, the shared weights never do.

The engine's own implementations are the references: TorchAttentionBackend and
TritonAttentionBackend (layers/attention.py), BlockManager (engine/block_manager.py),
ContinuousBatching / StaticBatching (engine/scheduler.py), NgramProposer (speculative/ngram.py),
SelfDraftProposer / DraftModelProposer (speculative/draft.py) and SpecVerifier (speculative/verify.py),
TorchSampler (layers/sampler.py); each QuantizedLinear's own path (quant/linear.py), add_lora_delta
(layers/lora.py), route and the experts' loop (models/moe.py, kernels/fused_moe.py), MegatronSharding
(models/shard.py).

Floor 0: this module imports nothing of minillm (the annotations name types of higher floors
as strings only).
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar, Protocol

# =================================================================== attention backends
# A backend declares `layout`: which batch metadata the model runner builds for it.
#   "sequence"      store_kv + attend, one call per sequence (the simplest to write)
#   "padded_decode" "sequence", plus decode_padded for decode steps: every sequence's key slots
#                   padded to one width, one call for the whole batch
#   "block_tables"  store_kv + decode + extend over the whole batch, reading block tables in place
ATTENTION_LAYOUTS = ("sequence", "padded_decode", "block_tables")


class SequenceAttention(Protocol):
    """layout = "sequence": the layer gathers each sequence's keys and calls attend once per sequence.

    Quantized KV pools (kv_dtype="int8" / "fp8") pass k_scale= and v_scale= ([num_kv_heads, num_slots]
    fp32) to store_kv, which then quantizes each new token per head; attend always gets model-dtype keys.
    """

    layout: ClassVar[str]

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        """k_cache, v_cache: [num_kv_heads, num_slots, head_dim] one layer's pool;
        k, v: [num_tokens, num_kv_heads, head_dim] this step's new keys/values;
        slot_mapping: [num_tokens] int64, the pool slot of each new token."""

    def attend(self, q, k, v, scale, num_cached):
        """q: [num_q, num_heads, head_dim] one sequence's new queries; k, v: [num_kv_heads, num_keys,
        head_dim] every key it may see, oldest first; num_cached: keys before the first query (query i
        sits at position num_cached + i) -> [num_q, num_heads, head_dim]."""


class PaddedDecodeAttention(SequenceAttention, Protocol):
    """layout = "padded_decode": "sequence", and a decode step of several sequences in one call."""

    def decode_padded(self, q, k_cache, v_cache, read, mask, scale):
        """q: [B, num_heads, head_dim]; read: [B, L] int64 pool slots (padding repeats a slot);
        mask: [B, 1, 1, L] bool, False on the padding -> [B, num_heads, head_dim]."""


class BlockTableAttention(Protocol):
    """layout = "block_tables": whole-batch kernels that walk block tables (AttentionMetadata's
    block_tables, seq_lens, query_start_loc, max_query_len, block_size). The layer calls store_kv,
    then decode when every sequence has one new token, else extend (prefill, chunks, mixed steps)."""

    layout: ClassVar[str]

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        """As SequenceAttention.store_kv."""

    def decode(self, q, k_cache, v_cache, meta, scale):
        """q: [B, num_heads, head_dim], one query per sequence -> [B, num_heads, head_dim]."""

    def extend(self, q, k_cache, v_cache, meta, scale):
        """q: [T, num_heads, head_dim], each sequence's new tokens after its cached ones -> [T, num_heads, head_dim]."""


ATTENTION_PROTOCOLS = {"sequence": SequenceAttention, "padded_decode": PaddedDecodeAttention,
                       "block_tables": BlockTableAttention}


# =================================================================== KV blocks
class BlockAllocator(Protocol):
    """The KV pool's bookkeeping: which blocks each sequence's table holds. A table is a list of block
    ids; token t of a sequence lives in slot table[t // block_size] * block_size + t % block_size.
    contiguous=True hands each request one run of consecutive blocks for max_model_len tokens."""

    num_blocks: int
    block_size: int
    contiguous: bool

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether allocate(num_tokens) would succeed now."""

    def allocate(self, num_tokens: int) -> list[int]:
        """A new table holding num_tokens tokens."""

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        """Whether grow(table, num_tokens) would succeed now."""

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` (in place) until it holds num_tokens tokens."""

    def free(self, table: list[int]) -> None:
        """Give a table's blocks back to the pool."""

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""

    def usage(self, real_tokens: int):
        """A BlockUsage (engine/block_manager.py): blocks in use, reserved slots, utilization."""


class Truncation(Protocol):
    """speculative=...: proposals are written to the cache, then the rejected ones are dropped."""

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Free the blocks of `table` (in place) past the first num_tokens tokens."""


class Forking(Protocol):
    """n > 1: the continuations of one prompt share its blocks (reference counts, copy-on-write)."""

    def share(self, table: list[int]) -> list[int]:
        """Another owner for every block of `table`; returns a copy of the table."""

    def shared_blocks(self, table: list[int], start: int, end: int) -> int:
        """Blocks of `table` holding positions [start, end) that other owners hold too."""

    def copy_on_write(self, table: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Swap a private copy into `table` for each of those blocks; -> (source, copy) pairs to copy K/V."""


class PrefixCache(Protocol):
    """prefix_caching=True: full blocks are keyed by a hash chain and shared between requests."""

    def hash_block(self, parent: Hashable | None, token_ids: Sequence[int], salt: str | None) -> Hashable:
        """The key of a full block: its parent block's key, its tokens and the request's cache salt."""

    def match(self, token_ids: Sequence[int], keys: Sequence[Hashable], salt: str | None) -> list[int]:
        """The cached blocks holding the longest run of `keys` (reads only)."""

    def can_allocate_cached(self, prefix: list[int], num_tokens: int) -> bool:
        """Whether allocate_cached(prefix, num_tokens) would succeed now."""

    def allocate_cached(self, prefix: list[int], num_tokens: int) -> list[int]:
        """A new table that shares the cached blocks `prefix`, then new blocks up to num_tokens."""

    def register(self, block: int, key: Hashable, token_ids: Sequence[int], salt: str | None,
                 parent: int | None) -> None:
        """Offer a full block (its K/V written) to the cache under `key`."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no running request holds."""


# =================================================================== scheduling
class SchedulingPolicy(Protocol):
    """When new requests join the running batch, and which running one gives its blocks back when
    the pool runs out (it is prefilled again later). Requests are admitted in arrival order."""

    def may_admit(self, running: Sequence) -> bool:
        """Whether waiting requests may join now, given the running sequences."""

    def preemption_victim(self, running: Sequence, keep: Sequence):
        """The running sequence to preempt (not one in `keep`, which already got blocks this step)."""


# =================================================================== speculative decoding
class Proposer(Protocol):
    """speculative=...: up to budgets[i] next tokens for each decoding sequence."""

    def propose(self, seqs: list, budgets: list[int]) -> tuple[list[list[int]], list]:
        """-> (proposals, draft_probs): proposals[i] has at most budgets[i] token ids; draft_probs[i] is
        the proposer's distribution [len(proposals[i]), vocab] for sampled requests, or None when the
        proposal is deterministic (all of q's mass on the proposed token)."""

    def accepted(self, seq, num_before: int, num_kept: int) -> None:
        """The target pass kept num_kept tokens after the sequence's first num_before: a proposer with
        its own cache keeps what stays valid."""

    def release(self, seq) -> None:
        """A sequence finished: free whatever the proposer holds for it."""


class Verifier(Protocol):
    """speculative=...: which proposed tokens a target pass keeps (always 1 to k + 1)."""

    def greedy(self, proposal: list[int], target_argmax: list[int]) -> list[int]:
        """The agreeing prefix of `proposal`, then the target's own next token (target_argmax has k + 1)."""

    def sample(self, proposal: list[int], draft_probs, target_probs, generator) -> list[int]:
        """Rejection sampling: draft_probs [k, vocab] or None, target_probs [k + 1, vocab]."""


class BatchVerifier(Protocol):
    """An optional ability of a Verifier: verify every greedy sequence of a speculative step at once (one kernel
    launch for the batch). The engine calls greedy_batch instead of greedy, once per step, when a verifier has it."""

    def greedy_batch(self, proposals: list[list[int]], target_argmax: list[list[int]]) -> list[list[int]]:
        """Per sequence, what greedy(proposals[i], target_argmax[i]) returns (target_argmax[i] has k_i + 1)."""


# =================================================================== sampling
class Sampler(Protocol):
    """Next-token logits -> one token id per sequence."""

    def sample(self, logits, batch) -> list[int]:
        """logits: [B, vocab] fp32 (raw); batch: a SamplingBatch (layers/sampler.py): per row its SamplingParams,
        torch.Generator (None when greedy), prompt and output token ids, and the ids min_tokens bans."""


# =================================================================== model parts (functions)
class QuantizedMatmul(Protocol):
    """quantized_matmul=fn (with weight_dtype="int8" / "int4" / "fp8"): every quantized layer of the engine's
    format computes y = fn(x, layer) instead of its own path (the bias is added after). A Triton kernel reads
    the layer's plain layout: layer.int4_parts() / layer.int8_parts() (quant/linear.py)."""

    def __call__(self, x, layer):
        """x: [M, in_features] activations (after the layer's input_scale division); layer: the QuantizedLinear
        -> [M, out_features]."""


class LoRADelta(Protocol):
    """lora_delta=fn (with enable_lora=True): each adapted projection adds fn's delta for every token of a step
    that has adapters, slice by slice (q, k, v of qkv_proj; gate, up of gate_up_proj)."""

    def __call__(self, x, a, b, batch):
        """x: [T, in] the projection's input; a: [S, r, in] and b: [S, out, r] every slot's matrices (slot 0
        zeros: no adapter); batch: the step's LoRABatch (layers/lora.py: token_slots [T], the segments)
        -> the delta [T, out]."""


class MoERouter(Protocol):
    """moe_router=fn (a Mixtral-style model): each MoE layer routes its tokens with fn."""

    def __call__(self, router_logits, top_k):
        """router_logits: [T, E]; top_k: experts per token -> (weights [T, top_k], expert ids [T, top_k] int64)."""


class MoEExperts(Protocol):
    """moe_experts=fn (a Mixtral-style model): each MoE layer runs its experts with fn."""

    def __call__(self, x, topk_weights, topk_ids, w13, w2):
        """x: [T, H]; topk_weights, topk_ids: [T, k]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]
        -> [T, H], each token's weighted sum of its experts' SwiGLU outputs."""


FUNCTION_PROTOCOLS = (QuantizedMatmul, LoRADelta, MoERouter, MoEExperts)


# =================================================================== tensor parallelism
class TensorSharding(Protocol):
    """sharding=part (with tensor_parallel_size=N > 1, float weights, local worker processes): how each rank cuts
    its shard of every linear layer and computes a row-parallel layer's output. Every rank runs the part in its own
    process: it travels to the workers by value (cloudpickle), so a class defined in a notebook works. Column-parallel
    matrices are q, k, v of qkv_proj and gate, up of gate_up_proj (each cut on its own, then stacked); row-parallel
    ones are o_proj and down_proj. A 1-D bias of a column-parallel matrix is cut as a [out, 1] weight."""

    def column(self, weight, rank, world_size):
        """weight: [out, in] one column-parallel matrix -> rank `rank`'s output rows [out / world_size, in]."""

    def row(self, weight, rank, world_size):
        """weight: [out, in] one row-parallel matrix -> rank `rank`'s input columns [out, in / world_size]."""

    def row_matmul(self, x, weight, all_reduce):
        """x: [T, in / N] this rank's input features; weight: [out, in / N] this rank's shard (from row());
        all_reduce(t): t summed over every rank (in place; returns it) -> [T, out], the whole layer's output
        (without its bias, which the engine adds once after)."""


# =================================================================== the check
class PartError(TypeError, ValueError):
    """A part that misses an attribute or a method of its protocol (raised when the engine is built)."""


def protocol_members(protocol: type) -> tuple[list[str], list[str]]:
    """(methods, attributes) a protocol declares, its bases' included, in declaration order."""
    methods, attributes = [], []
    for klass in reversed(protocol.__mro__):
        if klass is object or klass is Protocol or not getattr(klass, "_is_protocol", False):
            continue
        for name in getattr(klass, "__annotations__", {}):
            if not name.startswith("_") and name not in attributes:
                attributes.append(name)
        for name, value in vars(klass).items():
            if not name.startswith("_") and callable(value) and name not in methods:
                methods.append(name)
    return methods, attributes


def signature(fn) -> str:
    """`(self, table: list[int], num_tokens: int) -> None`, annotations as written."""
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        text = p.name if p.annotation is inspect.Parameter.empty else f"{p.name}: {p.annotation}"
        params.append(text if p.default is inspect.Parameter.empty else f"{text} = {p.default!r}")
    returns = "" if sig.return_annotation is inspect.Signature.empty else f" -> {sig.return_annotation}"
    return f"({', '.join(params)}){returns}"


def describe(protocol: type) -> str:
    """The protocol as a learner would write it: its attributes and method signatures."""
    methods, attributes = protocol_members(protocol)
    lines = [f"class {protocol.__name__}:"]
    annotations = {k: v for klass in reversed(protocol.__mro__) for k, v in vars(klass).get("__annotations__", {}).items()}
    lines += [f"    {name}: {str(annotations[name]).removeprefix('ClassVar[').removesuffix(']')}" for name in attributes]
    for name in methods:
        fn = next(vars(k)[name] for k in protocol.__mro__ if name in vars(k))
        lines.append(f"    def {name}{signature(fn)}: ...")
    return "\n".join(lines)


def check_function(part: Any, protocol: type, role: str) -> Any:
    """Refuse `part` unless it is callable with the positional arguments of `protocol.__call__`."""
    params = list(inspect.signature(protocol.__call__).parameters)[1:]
    expected = f"{role}(" + ", ".join(params) + ")"
    if not callable(part):
        raise PartError(f"{role}={part!r} is not callable; a {protocol.__name__} is a function {expected}:\n"
                        f"{inspect.getdoc(protocol.__call__)}")
    try:
        sig = inspect.signature(part)
    except (TypeError, ValueError):   # a builtin without a signature: taken as it is
        return part
    try:
        sig.bind(*params)
    except TypeError as exc:
        raise PartError(f"{role}={getattr(part, '__name__', type(part).__name__)}{sig} cannot be called as "
                        f"{expected} ({exc}); a {protocol.__name__}:\n{inspect.getdoc(protocol.__call__)}") from None
    return part


def check_part(part: Any, protocols: type | Sequence[type], role: str) -> Any:
    """Refuse `part` unless it has every attribute and method of `protocols` (methods callable; a function
    protocol's part is callable with its arguments). Returns the part. `role` names the argument in the
    message (e.g. "block_manager")."""
    protocols = [protocols] if isinstance(protocols, type) else list(protocols)
    for protocol in protocols:
        if protocol in FUNCTION_PROTOCOLS:
            check_function(part, protocol, role)
            continue
        methods, attributes = protocol_members(protocol)
        missing = [name for name in attributes if not hasattr(part, name)]
        missing += [f"{name}()" for name in methods if not callable(getattr(part, name, None))]
        if missing:
            raise PartError(f"{role}={type(part).__name__} object is missing {', '.join(missing)}; "
                            f"a {protocol.__name__} has:\n{describe(protocol)}")
    return part


def conforms(part: Any, protocol: type) -> bool:
    """Whether `part` has every attribute and method of `protocol` (for optional abilities)."""
    methods, attributes = protocol_members(protocol)
    return all(hasattr(part, name) for name in attributes) and all(callable(getattr(part, name, None))
                                                                   for name in methods)


def check_attention_backend(backend: Any) -> Any:
    """An attention backend declares its layout, then has that layout's methods."""
    layout = getattr(backend, "layout", None)
    if layout not in ATTENTION_PROTOCOLS:
        raise PartError(f"attention_backend={type(backend).__name__} object has layout={layout!r}; an attention "
                        f"backend declares `layout`, one of {ATTENTION_LAYOUTS}, and has that layout's methods: "
                        "'sequence': store_kv() and attend(); 'padded_decode': store_kv() and attend() and "
                        "decode_padded(); 'block_tables': store_kv(), decode() and extend():\n"
                        + "\n".join(describe(p) for p in ATTENTION_PROTOCOLS.values()))
    return check_part(backend, ATTENTION_PROTOCOLS[layout], "attention_backend")
