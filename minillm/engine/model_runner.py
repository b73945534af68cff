"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples tokens.

Everything of a pass that is not a weight is the runner's, and reaches the model in a ForwardContext
(layers/context.py) built for each pass: the KV pool, the attention backend, which kernels run the small
ops, the step's LoRA batch, the engine's model parts (quantized matmul, LoRA delta, MoE router and
experts) and the fused CPU decode plans. The model itself holds weights only, so engines sharing it
(LLM.with_levers) never see each other's.

The attention metadata comes from one builder per attention layout (minillm/seams.py): every
layout gets the flat batch (query_lens, num_cached, slot_mapping); "sequence" adds the slots each
sequence reads, "padded_decode" the same except on decode steps of several sequences (one padded
[B, L] slot matrix and mask instead), "block_tables" the whole batch's block tables.
"""

from __future__ import annotations

import torch

from ..layers.attention import AttentionMetadata, CPUAttentionBackend, resolve_backend
from ..layers.context import NO_PARTS, ForwardContext, ModelParts
from ..layers.lora import LoRABatch, LoRAWeights, build_batch
from ..layers.sampler import SamplingBatch, TorchSampler, token_logprobs
from ..models.moe import expert_token_counts
from ..seams import Sampler
from .block_manager import BlockManager
from .cuda_graph import DecodeGraphs
from .sequence import Sequence


def _float_dtype(model) -> torch.dtype | None:
    """The model's activation dtype: its first floating-point parameter's (None for a stand-in that is no Module)."""
    if not isinstance(model, torch.nn.Module):
        return None
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _sequence_reads(meta: AttentionMetadata, kv_read: list, device) -> None:
    """layout "sequence": the pool slots of each sequence's keys (a slice for a contiguous reservation)."""
    meta.kv_read = [r if isinstance(r, slice) else torch.tensor(r, dtype=torch.long, device=device) for r in kv_read]


def _padded_reads(meta: AttentionMetadata, kv_read: list, device) -> None:
    """layout "padded_decode": a decode step of several sequences reads one padded [B, L] slot matrix
    (padding repeats a sequence's first slot, masked out); any other step reads per sequence."""
    if len(kv_read) < 2 or max(meta.query_lens) != 1:
        return _sequence_reads(meta, kv_read, device)
    width = max(c + 1 for c in meta.num_cached)
    read, mask = [], []
    for r, c in zip(kv_read, meta.num_cached):
        seq_slots = list(range(r.start, r.stop)) if isinstance(r, slice) else r
        read.append(seq_slots + [seq_slots[0]] * (width - c - 1))
        mask.append([True] * (c + 1) + [False] * (width - c - 1))
    meta.decode_read = torch.tensor(read, dtype=torch.long, device=device)
    meta.decode_mask = torch.tensor(mask, dtype=torch.bool, device=device)[:, None, None, :]


def _block_tables(meta: AttentionMetadata, seqs: list[Sequence], block_size: int, device) -> None:
    """layout "block_tables": tables padded with block 0, keys per sequence, query offsets.
    Contiguous reservations are runs of blocks, so they have block tables too."""
    width = max(len(s.block_table) for s in seqs)
    meta.block_size = block_size
    meta.block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                     dtype=torch.int32, device=device)
    meta.seq_lens = torch.tensor([c + n for c, n in zip(meta.num_cached, meta.query_lens)], dtype=torch.int32,
                                 device=device)
    starts = [0]
    for n in meta.query_lens:
        starts.append(starts[-1] + n)
    meta.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    meta.max_query_len = max(meta.query_lens)


class ModelRunner:
    def __init__(self, model, device: torch.device, block_manager: BlockManager | None, kv_cache=None,
                 attention_backend="torch", sampler: Sampler | None = None, parts: ModelParts = NO_PARTS,
                 eos_token_ids: tuple[int, ...] = ()):
        self.model = model
        self.device = device
        self.block_manager = block_manager
        self.kv_cache = kv_cache
        self.sampler = sampler if sampler is not None else TorchSampler()
        self.parts = parts                         # the engine's model parts (checked by the builder)
        self.eos_token_ids = tuple(eos_token_ids)   # banned until a request's min_tokens
        self.grammars = None   # a GrammarBackend (minillm/structured.py), made at the first structured request
        self.graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs (cuda_graphs=True)
        self.lora: LoRAWeights | None = None       # set by enable_lora (enable_lora=True): the adapter slots
        self.lora_registry = None                  # the engine's LoRARegistry: adapters by id
        self.fuse_cpu_decode = True   # with the CPU kernels: a decode step's layers in one C call (models/cpu_decode.py)
        self.cpu_plans: dict = {}     # its plans, by layer count
        self.expert_tokens: dict = {}   # MoE layer -> [E] tokens routed since pop_expert_tokens
        self.set_attention_backend(attention_backend)

    def set_attention_backend(self, backend) -> None:
        """"auto", "torch", "triton", "cpu" or an object of one of the attention protocols (checked here)."""
        kv_dtype = self.kv_cache.kv_dtype if self.kv_cache is not None else None
        if backend == "auto" and self.kv_cache is None:   # the kernels' backends read a KV pool
            backend = "torch"
        self.backend = resolve_backend(backend, kv_dtype, self.device, _float_dtype(self.model))
        # The Triton backend brings the model's other Triton ops along (RMSNorm, rotary, SiLU-and-mul);
        # only its captured decode steps are replayed as CUDA graphs. The CPU backend brings the CPU
        # kernels' versions of the same ops.
        self.ops = "triton" if backend == "triton" else "cpu" if isinstance(self.backend, CPUAttentionBackend) else "torch"
        self.cpu_plans.clear()
        if self.graphs is not None:  # captured graphs hold the old backend's launches
            self.graphs.reset()

    def context(self, meta: AttentionMetadata, lora: LoRABatch | None = None) -> ForwardContext:
        """This engine's ForwardContext for one pass over `meta`'s batch."""
        return ForwardContext(meta, self.backend, self.kv_cache if meta.use_cache else None, self.ops, self.parts,
                              lora, self.expert_tokens, self.cpu_plans if self.fuse_cpu_decode else None)

    def pop_expert_tokens(self) -> list[list[int]] | None:
        """Tokens routed to each expert [moe_layer][expert] by this runner's passes since the last call, then
        reset (None: a dense model, or no pass counted)."""
        counts = expert_token_counts(self.model, self.expert_tokens)
        self.expert_tokens.clear()
        return counts

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Decode steps replay captured CUDA graphs (captured at the first decode step).

        capture=False runs the same padded static-buffer path eagerly (for CPU tests).
        """
        if self.block_manager is None:
            raise ValueError("cuda_graphs=True needs kv_cache=True")
        self.graphs = DecodeGraphs(self.model, self.context, self.device, self.block_manager.block_size,
                                   max_num_seqs, max_model_len, capture=capture)

    def enable_lora(self, registry, max_loras: int, max_lora_rank: int, dtype: torch.dtype) -> None:
        """enable_lora=True: max_loras zeroed adapter slots for the model's adapted layers (this runner's own)."""
        self.lora = LoRAWeights(self.model, max_loras, max_lora_rank, dtype, self.device)
        self.lora_registry = registry

    def prepare_lora(self, seqs: list[Sequence], query_lens: list[int]) -> LoRABatch | None:
        """Each token's adapter slot (the scheduler gave each sequence its slot), with the SGMV segments;
        an adapter whose slot another one occupied last is copied in first. None: no adapter in this step."""
        if self.lora is None:
            return None
        slots = [s.lora_slot for s in seqs]
        for seq in seqs:
            if seq.lora_slot:
                self.lora.load(seq.lora_slot, self.lora_registry.adapters[seq.lora_request.lora_int_id])
        return build_batch(self.lora, slots, query_lens, self.device, self.ops == "triton")

    def prepare(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids and positions, the attention metadata (built for the backend's layout), and
        each sequence's last row."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, num_cached, kv_read, last_rows = [], [], [], []
        use_cache = self.block_manager is not None
        bm = self.block_manager
        for seq in seqs:
            if use_cache:
                start = seq.num_cached_tokens
                end = start + (seq.num_scheduled_tokens or len(seq) - start)  # a prompt chunk may stop early
            else:
                start, end = 0, len(seq)  # no cache: recompute from token 0
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(end - start)
            num_cached.append(start)
            last_rows.append(len(input_ids) - 1)
            if use_cache:
                table = seq.block_table
                if bm.contiguous:
                    base = table[0] * bm.block_size
                    slots.extend(range(base + start, base + end))
                    kv_read.append(slice(base, base + end))
                else:
                    size = bm.block_size
                    seq_slots = [b * size + o for b in table[:-(-end // size)] for o in range(size)][:end]
                    slots.extend(seq_slots[start:])
                    kv_read.append(seq_slots)
        dev = self.device
        meta = AttentionMetadata(
            query_lens=query_lens,
            num_cached=num_cached,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev) if use_cache else None,
            use_cache=use_cache,
        )
        if use_cache:
            layout = self.backend.layout
            if layout == "block_tables":
                _block_tables(meta, seqs, bm.block_size, dev)
            elif layout == "padded_decode":
                _padded_reads(meta, kv_read, dev)
            else:
                _sequence_reads(meta, kv_read, dev)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta, last_rows)

    @torch.inference_mode()
    def logits(self, seqs: list[Sequence], rows: list[int] | None = None, prompt_logprobs: bool = False) -> torch.Tensor:
        """Next-token logits [len(rows or seqs), vocab] in fp32 (rows: which sequences need them); with
        prompt_logprobs, the requests that ask for them record their prompt tokens' logprobs on the way."""
        if self.graphs is not None and self.ops == "triton" and self.graphs.can_run(seqs):
            logits = self.graphs.logits(seqs)  # a decode step: one token per sequence
            return logits if rows is None else logits[rows]
        input_ids, positions, meta, last_rows = self.prepare(seqs)
        if rows is not None:
            last_rows = [last_rows[i] for i in rows]
        hidden = self.forward(input_ids, positions, meta, self.prepare_lora(seqs, meta.query_lens))
        if prompt_logprobs:
            self._record_prompt_logprobs(seqs, hidden, positions)
        if len(last_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(last_rows, dtype=torch.long, device=hidden.device)]
        return self.compute_logits(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                lora: LoRABatch | None = None, num_layers: int | None = None) -> torch.Tensor:
        """The model's hidden states over this engine's pool and parts; with `lora`, the step's adapters.
        num_layers: only the first layers, then the final norm (the "self" proposer's early exit)."""
        return self.model(input_ids, positions, self.context(meta, lora), num_layers=num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab], with this engine's parts."""
        return self.model.compute_logits(hidden, self.parts)

    def _record_prompt_logprobs(self, seqs: list[Sequence], hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """prompt_logprobs=N: the log-probability of each prompt token after the ones before it, from the hidden
        states of this step's prompt rows (a chunk at a time; a recomputed prefill records nothing twice)."""
        wanted = [s.params.prompt_logprobs is not None and len(s.prompt_logprobs) < s.num_prompt_tokens - 1
                  for s in seqs]
        if not any(wanted):
            return
        row = 0
        for seq in seqs:
            count = seq.num_scheduled_tokens or len(seq) - seq.num_cached_tokens if self.block_manager else len(seq)
            first = int(positions[row])
            if seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
                # row r (position first + r) predicts the token at first + r + 1; keep the new prompt ones
                done = len(seq.prompt_logprobs)
                lo, hi = max(done, first), min(seq.num_prompt_tokens - 1, first + count)
                if lo < hi:
                    logits = self.compute_logits(hidden[row + lo - first: row + hi - first])
                    targets = seq.prompt_token_ids[lo + 1: hi + 1]
                    for token, entry in zip(targets, token_logprobs(logits, targets,
                                                                    [seq.params.prompt_logprobs] * len(targets))):
                        seq.prompt_logprobs.append((token, *entry))
            row += count

    def run(self, seqs: list[Sequence]) -> list[int | None]:
        """One token per sequence whose step reaches its last token; None for a prompt chunk
        that stops short (it samples nothing, so seeded sampling does not depend on chunking)."""
        if self.block_manager is None:
            done = list(seqs)
        else:
            done = [s for s in seqs if s.num_cached_tokens + (s.num_scheduled_tokens or len(s)) >= len(s)]
        if len(done) == len(seqs):
            logits = self.logits(seqs, prompt_logprobs=True)
        else:
            rows = [i for i, s in enumerate(seqs) if s in done]
            logits = self.logits(seqs, rows, prompt_logprobs=True)
        raw = logits
        matchers = [s.grammar for s in done]
        if self.grammars is not None and any(m is not None for m in matchers):
            logits = logits.clone()               # logprobs stay the model's own (the raw logits)
            self.grammars.apply(logits, matchers)   # structured output: tokens that break the grammar at -inf
        sampled = self.sampler.sample(logits, SamplingBatch.from_sequences(done, self.eos_token_ids))
        for seq, token in zip(done, sampled):
            if seq.grammar is not None and not seq.grammar.is_terminated() and not seq.grammar.accept_token(token):
                raise RuntimeError(f"request {seq.request_id}: token {token} breaks its grammar (a sampler that "
                                   "ignores the mask?)")
        recorded = [s.params.recorded_logprobs for s in done]   # logprobs=N, or best_of ranking
        if any(n is not None for n in recorded):
            record_logprobs(done, sampled, token_logprobs(raw, sampled, recorded))
        tokens = iter(sampled)
        return [next(tokens) if s in done else None for s in seqs]


def record_logprobs(seqs: list[Sequence], tokens: list[int], entries: list) -> None:
    """Keep each sampled token's log-probability (and the top-N) on its sequence, in output order."""
    for seq, token, entry in zip(seqs, tokens, entries):
        if entry is not None:
            logprob, rank, top = entry
            seq.logprobs.append((token, logprob, rank, top))
            seq.cumulative_logprob += logprob
