"""Speculative decoding inside the engine's decode steps (`speculative=` lever).

One speculative step, for every decoding sequence of the batch at once:

1. propose up to k = `num_speculative_tokens` next tokens per sequence: "ngram" looks them up
   in the sequence itself (minillm/spec/ngram.py, no model); "self" runs the target's first
   `draft_num_layers` layers, its final norm and its head k times (an early exit, as in
   LayerSkip): no second model and no second cache, since those layers' K/V are exactly the
   target's own for the same tokens (the target pass rewrites them anyway); "draft" runs a
   second, smaller model (`draft_model`, same tokenizer) k times, with its own KV pool and
   block tables (DraftWorker): it first catches up on the tokens it has not seen (the prompt,
   the target's last token, accepted proposals), then drafts one token per pass;
2. one target pass scores all of them: each sequence feeds its last token plus its proposals
   as a short extend chunk (the same path as a chunked prefill over the paged cache), and the
   logits of all k + 1 positions come back;
3. verify (minillm/spec/verify.py): greedy keeps the agreeing prefix plus the target's own next
   token, so the output equals the target alone; sampling uses rejection sampling, so the
   output distribution equals the target's;
4. postprocess (Scheduler.postprocess_many): append the kept tokens, stop where a stop
   condition hits, and free the blocks that only held rejected positions. The K/V written for
   rejected positions inside a kept block are garbage past the sequence's length; the next
   step overwrites them.

A sequence whose proposal is empty, or whose extra blocks do not fit, takes a plain one-token
step inside the same pass. Proposals never run past max_tokens or max_model_len.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.sampler import filter_logits
from ..spec.ngram import ngram_propose
from ..spec.verify import greedy_verify, rejection_sample
from .block_manager import BlockManager
from .kv_cache import KVCache
from .metrics import SpecStats
from .model_runner import ModelRunner
from .sequence import Sequence

PROPOSERS = ("ngram", "self", "draft")


@dataclass(eq=False)
class DraftState:
    """What the draft model holds for one target sequence: the tokens it has fed (a prefix of
    the target's tokens, then its own proposals during a step) and where their K/V live in the
    draft's pool. ModelRunner.prepare reads it like a Sequence."""

    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_scheduled_tokens: int = 0
    block_table: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


class DraftWorker:
    """A second model that proposes (speculative="draft"): its own weights, KV pool, block
    manager and runner. Its pool has as many blocks as the target's, so a sequence the target
    can hold the draft can hold too; its states are freed when their sequences finish."""

    def __init__(self, model, model_config, device: torch.device, dtype: torch.dtype, num_blocks: int,
                 block_size: int, attention_backend="torch"):
        self.model = model
        self.model_config = model_config
        self.block_manager = BlockManager(num_blocks, block_size, contiguous=False)
        self.kv_cache = KVCache(model_config, num_blocks, block_size, dtype, device)
        self.runner = ModelRunner(model, device, self.block_manager, self.kv_cache, attention_backend)
        self.states: dict[int, DraftState] = {}    # seq_id -> its draft state

    def state(self, seq: Sequence) -> DraftState:
        return self.states.setdefault(seq.seq_id, DraftState())

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None and state.block_table:
            self.block_manager.free(state.block_table)


class Speculator:
    def __init__(self, method: str, num_speculative_tokens: int, runner, block_manager, max_model_len: int,
                 draft_num_layers: int | None = None, draft: DraftWorker | None = None):
        if method not in PROPOSERS:
            raise ValueError(f"speculative={method!r} is not one of {PROPOSERS}")
        if (method == "draft") != (draft is not None):
            raise ValueError("speculative='draft' needs a DraftWorker (and only it does)")
        self.method = method
        self.draft = draft
        num_layers = len(runner.model.layers)
        if method == "self":
            draft_num_layers = draft_num_layers or max(1, num_layers // 4)
            if not 1 <= draft_num_layers < num_layers:
                raise ValueError(f"draft_num_layers={draft_num_layers} must be in [1, {num_layers - 1}]: the draft is "
                                 f"the first layers of this {num_layers}-layer model")
        self.draft_num_layers = draft_num_layers
        self.k = num_speculative_tokens
        self.runner = runner
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    def _budget(self, seq: Sequence) -> int:
        """Proposals that can still become output: the last kept token is always the target's own."""
        left_tokens = seq.params.max_tokens - seq.num_output_tokens - 1
        left_context = self.max_model_len - len(seq) - 1
        return max(0, min(self.k, left_tokens, left_context))

    def _propose_ngram(self, seqs: list[Sequence], budgets: list[int]) -> list[list[int]]:
        return [ngram_propose(seq.token_ids, b) if b else [] for seq, b in zip(seqs, budgets)]

    def _draft_loop(self, seqs: list[Sequence], budgets: list[int], forward) -> tuple[list[list[int]], list]:
        """Up to max(budgets) draft passes over the batch; pass j proposes token j of every
        sequence whose budget exceeds j. `forward(active, drafts, j) -> logits [len(active), vocab]`.
        Returns the proposals and, for sampled sequences, the draft's probabilities [k_i, vocab]."""
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(budgets, default=0)):
            active = [i for i, b in enumerate(budgets) if b > j]
            logits = forward(active, drafts, j)
            self.stats.num_draft_passes += 1
            for row, i in enumerate(active):
                p = seqs[i].params
                if p.temperature == 0.0:
                    drafts[i].append(int(logits[row].argmax()))
                else:
                    q = filter_logits(logits[row], p.temperature, p.top_k, p.top_p).softmax(-1)
                    drafts[i].append(int(torch.multinomial(q, 1, generator=seqs[i].generator).item()))
                    probs[i].append(q)
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _propose_self(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[list[int]], list]:
        """Draft with the target's first layers, feeding each sequence's newest token (the real
        last one, then each draft) on top of the target's own cache."""
        runner, model = self.runner, self.runner.model
        saved = [(len(seq), seq.num_cached_tokens, seq.num_scheduled_tokens) for seq in seqs]

        def forward(active, drafts, j):
            batch = [seqs[i] for i in active]
            for i in active:
                seq = seqs[i]
                del seq.token_ids[saved[i][0]:]
                seq.token_ids.extend(drafts[i])
                seq.num_cached_tokens = len(seq) - 1
                seq.num_scheduled_tokens = 1
            input_ids, positions, meta, last_rows = runner.prepare(batch)
            hidden = model(input_ids, positions, meta, num_layers=self.draft_num_layers)
            return model.compute_logits(hidden[torch.tensor(last_rows, dtype=torch.long, device=hidden.device)])

        try:
            return self._draft_loop(seqs, budgets, forward)
        finally:
            for seq, (n, cached, scheduled) in zip(seqs, saved):
                del seq.token_ids[n:]
                seq.num_cached_tokens, seq.num_scheduled_tokens = cached, scheduled

    def _propose_draft(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[list[int]], list]:
        """Draft with the second model. Pass 0 feeds each sequence the tokens its draft state has
        not cached yet (the whole prompt the first time; afterwards the target's last token and
        any accepted proposals the draft never fed); later passes feed the previous proposal."""
        worker = self.draft
        bm = worker.block_manager
        states: dict[int, DraftState] = {}
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            if not budget:
                continue
            state = worker.state(seq)
            cached = min(state.num_cached_tokens, len(seq) - 1)
            bm.truncate(state.block_table, cached)
            if not bm.can_grow(state.block_table, len(seq) + budget - 1):
                budgets[i] = 0     # the draft pool is full: a plain step for this sequence
                continue
            bm.grow(state.block_table, len(seq) + budget - 1)
            state.token_ids = list(seq.token_ids)
            state.num_cached_tokens = cached
            states[i] = state

        def forward(active, drafts, j):
            batch = []
            for i in active:
                state = states[i]
                if j:
                    state.token_ids.append(drafts[i][-1])
                    state.num_cached_tokens = len(state) - 1
                state.num_scheduled_tokens = len(state) - state.num_cached_tokens
                batch.append(state)
            logits = worker.runner.logits(batch)
            for state in batch:
                state.num_cached_tokens = len(state)
            return logits

        return self._draft_loop(seqs, budgets, forward)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """One target pass over `seqs` (decoding, their tables hold len(seq) tokens) -> the tokens
        each sequence keeps (1 to k + 1)."""
        bm, runner = self.block_manager, self.runner
        runner.bind()
        budgets = []
        for seq in seqs:
            budget = self._budget(seq)
            if budget and not bm.can_grow(seq.block_table, len(seq) + budget):
                budget = 0   # no room for the extra positions: a plain step for this one
            if budget:
                bm.grow(seq.block_table, len(seq) + budget)
            budgets.append(budget)
        if self.method == "self":
            proposals, draft_probs = self._propose_self(seqs, budgets)
        elif self.method == "draft":
            proposals, draft_probs = self._propose_draft(seqs, budgets)
        else:
            proposals, draft_probs = self._propose_ngram(seqs, budgets), [None] * len(seqs)
        # Feed last token + proposals: extend chunks that start at num_cached_tokens = len - 1.
        saved = [len(seq) for seq in seqs]
        for seq, proposal in zip(seqs, proposals):
            seq.token_ids.extend(proposal)
            seq.num_scheduled_tokens = 1 + len(proposal)
        try:
            input_ids, positions, meta, last_rows = runner.prepare(seqs)
            hidden = runner.model(input_ids, positions, meta)
            rows, spans = [], []
            for proposal, last in zip(proposals, last_rows):
                first = last - len(proposal)
                spans.append((len(rows), len(rows) + len(proposal) + 1))
                rows.extend(range(first, last + 1))
            if len(rows) != hidden.shape[0]:
                hidden = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
            logits = runner.model.compute_logits(hidden)   # [sum(k_i + 1), vocab] fp32
        finally:
            for seq, n in zip(seqs, saved):
                del seq.token_ids[n:]
        kept = []
        greedy_ids = logits.argmax(dim=-1).tolist()
        for seq, proposal, q, (a, b), n_before in zip(seqs, proposals, draft_probs, spans, saved):
            p = seq.params
            if p.temperature == 0.0:
                tokens = greedy_verify(proposal, greedy_ids[a:b])
            else:
                probs = torch.stack([filter_logits(logits[r], p.temperature, p.top_k, p.top_p).softmax(-1)
                                     for r in range(a, b)])
                tokens = rejection_sample(proposal, q, probs, generator=seq.generator)
            st = self.stats
            st.num_passes += 1
            st.num_proposed += len(proposal)
            st.num_accepted += len(tokens) - 1
            st.num_emitted += len(tokens)
            kept.append(tokens)
            if self.method == "draft" and proposal:
                # The draft cached the sequence and proposals 1..k-1; what stays valid is the
                # sequence plus the accepted proposals among those (the rest is overwritten later).
                state = self.draft.states[seq.seq_id]
                state.num_cached_tokens = min(state.num_cached_tokens, n_before + len(tokens) - 1)
                del state.token_ids[state.num_cached_tokens:]
        return kept

    def release_finished(self, seqs: list[Sequence]) -> None:
        """Free the draft states of finished sequences (no-op for proposers without a model)."""
        if self.draft is not None:
            for seq in seqs:
                if seq.is_finished:
                    self.draft.release(seq)
