"""Speculative decoding inside the engine's decode steps (`speculative=` lever).

One speculative step, for every decoding sequence of the batch at once:

1. propose up to k = `num_speculative_tokens` next tokens per sequence (minillm/spec: "ngram"
   looks them up in the sequence itself, no model);
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

PROPOSERS = ("ngram",)


class Speculator:
    def __init__(self, method: str, num_speculative_tokens: int, runner, block_manager, max_model_len: int):
        if method not in PROPOSERS:
            raise ValueError(f"speculative={method!r} is not one of {PROPOSERS}")
        self.method = method
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

    def propose(self, seq: Sequence) -> list[int]:
        budget = self._budget(seq)
        if budget == 0:
            return []
        return ngram_propose(seq.token_ids, budget)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """One target pass over `seqs` (decoding, their tables hold len(seq) tokens) -> the tokens
        each sequence keeps (1 to k + 1)."""
        bm = self.block_manager
        proposals = []
        for seq in seqs:
            proposal = self.propose(seq)
            if proposal and not bm.can_grow(seq.block_table, len(seq) + len(proposal)):
                proposal = []   # no room for the extra positions: a plain step for this one
            if proposal:
                bm.grow(seq.block_table, len(seq) + len(proposal))
            proposals.append(proposal)
        # Feed last token + proposals: extend chunks that start at num_cached_tokens = len - 1.
        saved = [len(seq) for seq in seqs]
        for seq, proposal in zip(seqs, proposals):
            seq.token_ids.extend(proposal)
            seq.num_scheduled_tokens = 1 + len(proposal)
        try:
            runner = self.runner
            runner.bind()
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
        for seq, proposal, (a, b) in zip(seqs, proposals, spans):
            p = seq.params
            if p.temperature == 0.0:
                tokens = greedy_verify(proposal, greedy_ids[a:b])
            else:
                probs = torch.stack([filter_logits(logits[r], p.temperature, p.top_k, p.top_p).softmax(-1)
                                     for r in range(a, b)])
                tokens = rejection_sample(proposal, None, probs, generator=seq.generator)
            st = self.stats
            st.num_passes += 1
            st.num_proposed += len(proposal)
            st.num_accepted += len(tokens) - 1
            st.num_emitted += len(tokens)
            kept.append(tokens)
        return kept
