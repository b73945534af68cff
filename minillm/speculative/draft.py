"""The model drafts (speculative="self" / "draft"): their proposers, the draft loop, the sampling rows.

"self" runs the target's first `draft_num_layers` layers, its final norm and its head k times (an
early exit, as in LayerSkip): no second model and no second cache, since those layers' K/V are
exactly the target's own for the same tokens (the target pass rewrites them anyway). "draft" runs a
second, smaller model (`draft_model`, same tokenizer) k times, with its own KV pool and block tables
(engine/speculator.py's DraftWorker): it first catches up on the tokens it has not seen (the prompt,
the target's last token, accepted proposals), then drafts one token per pass.

Both draw from the same processed settings applied to the draft's logits (penalties over the
history with the earlier drafts, the min_tokens ban, the grammar's mask as the matcher advances
through the drafts, rolled back afterwards): the closer q is to the target's p, the more proposals
are kept. Losslessness only needs each proposal to be drawn from the q handed to the verifier (or
to be deterministic, with q = None). `sampling_rows` / `process_rows` are also how the engine
processes the target's rows before verifying them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layers.sampler import SamplingBatch, apply_penalties, processed_probs
from .proposer import StatelessProposer


def sampling_rows(seqs: list["Sequence"], outputs: list[list[int]], eos_token_ids=()) -> SamplingBatch:
    """A SamplingBatch with one row per (sequence, output history) pair: the sequence's settings and generator, its
    prompt, and the output as it would be at that position (the output so far followed by the proposals before
    it), so the penalties and the min_tokens ban see what the plain engine would see there. A sequence may fill
    several rows."""
    eos = list(eos_token_ids)
    return SamplingBatch([s.params for s in seqs], [s.generator for s in seqs], [s.prompt_token_ids for s in seqs],
                         outputs, [([] if s.params.ignore_eos else eos) + list(s.params.stop_token_ids) for s in seqs])


def _subset(batch: SamplingBatch, rows: list[int]) -> SamplingBatch:
    return SamplingBatch([batch.params[r] for r in rows], [batch.generators[r] for r in rows],
                         [batch.prompt_token_ids[r] for r in rows], [batch.output_token_ids[r] for r in rows],
                         [batch.stop_token_ids[r] for r in rows])


def process_rows(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int | None], torch.Tensor | None, list[int]]:
    """What the plain sampler would do with each row, vectorised: -> (the argmax of the processed logits for
    greedy rows, None for sampled ones; the processed probabilities [len(sampled), V] of the sampled rows or
    None; the sampled rows' indices). The sampler module's apply_penalties / processed_probs do the work, so
    there is one implementation of the settings."""
    n = len(batch)
    greedy = [r for r, p in enumerate(batch.params) if p.temperature == 0.0]
    sampled = [r for r, p in enumerate(batch.params) if p.temperature != 0.0]
    argmax: list[int | None] = [None] * n
    if greedy:
        rows = logits if len(greedy) == n else logits[greedy]
        sub = batch if len(greedy) == n else _subset(batch, greedy)
        for r, token in zip(greedy, apply_penalties(rows, sub).argmax(dim=-1).tolist()):
            argmax[r] = token
    probs = None
    if sampled:
        rows = logits if len(sampled) == n else logits[sampled]
        probs = processed_probs(rows, batch if len(sampled) == n else _subset(batch, sampled))
    return argmax, probs, sampled


def draft_loop(seqs: list["Sequence"], budgets: list[int], forward, stats: "SpecStats",
               target: "ModelRunner | None" = None) -> tuple[list[list[int]], list]:
    """Up to max(budgets) draft passes over the batch; pass j proposes token j of every sequence
    whose budget exceeds j. `forward(active, drafts, j) -> logits [len(active), vocab]`. Returns the
    proposals and, for sampled sequences, the draft's probabilities [k_i, vocab].

    Each pass's logits are processed with the request's settings as the target's rows will be
    (`target`: the target's runner, for its EOS ids and grammar backend): the grammar's mask at the
    matcher's state after the earlier drafts (the matchers are rolled back at the end), logit_bias, the
    min_tokens ban, the penalties over the history including the earlier drafts; greedy rows take the
    argmax, sampled rows draw from the processed distribution, which is the q returned (the verifier
    needs the q each proposal was drawn from)."""
    drafts: list[list[int]] = [[] for _ in seqs]
    probs: list[list[torch.Tensor]] = [[] for _ in seqs]
    eos = target.eos_token_ids if target is not None else ()
    grammars = target.grammars if target is not None else None
    outputs = [list(seq.output_token_ids) for seq in seqs]   # before forward() feeds any draft
    advanced = [0] * len(seqs)          # draft tokens each matcher accepted (rolled back at the end)
    off_grammar = [False] * len(seqs)   # a draft the grammar refused (only when every token was masked)
    try:
        for j in range(max(budgets, default=0)):
            active = [i for i, b in enumerate(budgets) if b > j]
            logits = forward(active, drafts, j)
            stats.num_draft_passes += 1
            matchers = [live_matcher(seqs[i].grammar) if grammars is not None and not off_grammar[i] else None
                        for i in active]
            if any(m is not None for m in matchers):
                logits = logits.clone()
                grammars.apply(logits, matchers)
            argmax, q, sampled = process_rows(logits, sampling_rows([seqs[i] for i in active],
                                                                    [outputs[i] + drafts[i] for i in active], eos))
            q_row = {r: n for n, r in enumerate(sampled)}
            for row, i in enumerate(active):
                if row in q_row:
                    dist = q[q_row[row]]
                    drafts[i].append(int(torch.multinomial(dist, 1, generator=seqs[i].generator).item()))
                    probs[i].append(dist)
                else:
                    drafts[i].append(argmax[row])
                matcher = matchers[row]
                if matcher is not None:
                    if matcher.accept_token(drafts[i][-1]):
                        advanced[i] += 1
                    else:
                        off_grammar[i] = True
    finally:
        for seq, n in zip(seqs, advanced):
            if n:
                seq.grammar.rollback(n)
    return drafts, [torch.stack(p) if p else None for p in probs]


def live_matcher(matcher):
    """A matcher that can still give a mask: None for no grammar or a terminated one (it accepted EOS; the
    sequence stops there, so the rows after it are never kept)."""
    return matcher if matcher is not None and not matcher.is_terminated() else None


class SelfDraftProposer(StatelessProposer):
    """speculative="self": the target's first `num_layers` layers, its final norm and its head draft,
    on top of the target's own cache (an early exit, as in LayerSkip)."""

    def __init__(self, runner: "ModelRunner", num_layers: int, stats: Callable[[], "SpecStats"]):
        self.runner, self.num_layers, self.stats = runner, num_layers, stats   # stats(): the run's counters

    def propose(self, seqs: list["Sequence"], budgets: list[int]) -> tuple[list[list[int]], list]:
        """Feed each sequence's newest token (the real last one, then each draft)."""
        runner = self.runner
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
            hidden = runner.forward(input_ids, positions, meta, num_layers=self.num_layers)
            return runner.compute_logits(hidden[torch.tensor(last_rows, dtype=torch.long, device=hidden.device)])

        try:
            return draft_loop(seqs, budgets, forward, self.stats(), runner)
        finally:
            for seq, (n, cached, scheduled) in zip(seqs, saved):
                del seq.token_ids[n:]
                seq.num_cached_tokens, seq.num_scheduled_tokens = cached, scheduled


class DraftModelProposer:
    """speculative="draft": the second model of a DraftWorker, with its own pool and block tables.
    `target`: the target's runner (its EOS ids and grammar backend process the draft's logits as the
    target's will be; without it the draft samples from its settings minus the grammar and the EOS ban)."""

    def __init__(self, worker: "DraftWorker", stats: Callable[[], "SpecStats"],
                 target: "ModelRunner | None" = None):
        self.worker, self.stats, self.target = worker, stats, target   # stats(): the run's counters

    def propose(self, seqs: list["Sequence"], budgets: list[int]) -> tuple[list[list[int]], list]:
        """Pass 0 feeds each sequence the tokens its draft state has not cached yet (the whole prompt
        the first time; afterwards the target's last token and any accepted proposals the draft never
        fed); later passes feed the previous proposal."""
        worker = self.worker
        bm = worker.block_manager
        states: dict[int, "DraftState"] = {}
        budgets = list(budgets)
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

        return draft_loop(seqs, budgets, forward, self.stats(), self.target)

    def accepted(self, seq: "Sequence", num_before: int, num_kept: int) -> None:
        """The draft cached the sequence and proposals 1..k-1; what stays valid is the sequence plus
        the accepted proposals among those (the rest is overwritten later)."""
        state = self.worker.states[seq.seq_id]
        state.num_cached_tokens = min(state.num_cached_tokens, num_before + num_kept - 1)
        del state.token_ids[state.num_cached_tokens:]

    def release(self, seq: "Sequence") -> None:
        self.worker.release(seq)
