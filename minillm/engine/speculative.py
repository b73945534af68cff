"""Speculative decoding inside the engine's decode steps (`speculative=` lever).

One speculative step, for every decoding sequence of the batch at once:

1. propose up to k = `num_speculative_tokens` next tokens per sequence: "ngram" looks them up
   in the sequence itself (minillm/spec/ngram.py, no model); "self" runs the target's first
   `draft_num_layers` layers, its final norm and its head k times (an early exit, as in
   LayerSkip): no second model and no second cache, since those layers' K/V are exactly the
   target's own for the same tokens (the target pass rewrites them anyway);
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

import torch

from ..layers.sampler import filter_logits
from ..spec.ngram import ngram_propose
from ..spec.verify import greedy_verify, rejection_sample
from .metrics import SpecStats
from .sequence import Sequence

PROPOSERS = ("ngram", "self")


class Speculator:
    def __init__(self, method: str, num_speculative_tokens: int, runner, block_manager, max_model_len: int,
                 draft_num_layers: int | None = None):
        if method not in PROPOSERS:
            raise ValueError(f"speculative={method!r} is not one of {PROPOSERS}")
        self.method = method
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

    def _propose_self(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[list[int]], list]:
        """Draft with the first layers: up to max(budgets) one-token passes over the batch.
        Returns the proposals and, for sampled sequences, the draft's probabilities [k_i, vocab]."""
        runner, model = self.runner, self.runner.model
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        saved = [(len(seq), seq.num_cached_tokens, seq.num_scheduled_tokens) for seq in seqs]
        try:
            for j in range(max(budgets, default=0)):
                active = [i for i, b in enumerate(budgets) if b > j]
                batch = [seqs[i] for i in active]
                for i in active:   # feed the newest token (the real last one, then each draft)
                    seq = seqs[i]
                    del seq.token_ids[saved[i][0]:]
                    seq.token_ids.extend(drafts[i])
                    seq.num_cached_tokens = len(seq) - 1
                    seq.num_scheduled_tokens = 1
                input_ids, positions, meta, last_rows = runner.prepare(batch)
                hidden = model(input_ids, positions, meta, num_layers=self.draft_num_layers)
                logits = model.compute_logits(hidden[torch.tensor(last_rows, dtype=torch.long, device=hidden.device)])
                self.stats.num_draft_passes += 1
                for row, i in enumerate(active):
                    p = seqs[i].params
                    if p.temperature == 0.0:
                        drafts[i].append(int(logits[row].argmax()))
                    else:
                        q = filter_logits(logits[row], p.temperature, p.top_k, p.top_p).softmax(-1)
                        drafts[i].append(int(torch.multinomial(q, 1, generator=seqs[i].generator).item()))
                        probs[i].append(q)
        finally:
            for seq, (n, cached, scheduled) in zip(seqs, saved):
                del seq.token_ids[n:]
                seq.num_cached_tokens, seq.num_scheduled_tokens = cached, scheduled
        return drafts, [torch.stack(p) if p else None for p in probs]

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
        for seq, proposal, q, (a, b) in zip(seqs, proposals, draft_probs, spans):
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
        return kept
