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
3. verify (minillm/spec/verify.py) against the distribution the plain engine would sample from,
   not the raw logits: row j of a sequence's k + 1 rows is processed as if proposals[:j] had
   been emitted (one SamplingBatch row per position, the output so far plus proposals[:j], through
   the sampler's own apply_penalties / processed_probs, all rows in one call): structured output's
   grammar mask at that position, logit_bias, the min_tokens ban at that output length, the
   repetition / frequency / presence penalties over the history including proposals[:j], then
   temperature, min_p, top_k, top_p. Greedy keeps the agreeing prefix plus the target's own next
   token (argmax of the processed row), so the output equals the target alone; sampling uses
   rejection sampling against the processed rows, so the output distribution equals the
   target's. A proposal that breaks the grammar has probability 0 in its own row, so it and
   everything after it is rejected; the kept tokens are then accepted by the request's matcher;
4. postprocess (Scheduler.postprocess_many): append the kept tokens, stop where a stop
   condition hits, and free the blocks that only held rejected positions. The K/V written for
   rejected positions inside a kept block are garbage past the sequence's length; the next
   step overwrites them.

The model drafts ("self", "draft") draw from the same processed settings applied to the draft's
logits (penalties over the history with the earlier drafts, the min_tokens ban, the grammar's mask
as the matcher advances through the drafts, rolled back afterwards): the closer q is to the
target's p, the more proposals are kept. Losslessness only needs each proposal to be drawn from the
q handed to the verifier (or to be deterministic, with q = None).

A sequence whose proposal is empty, or whose extra blocks do not fit, takes a plain one-token
step inside the same pass. Proposals never run past max_tokens or max_model_len. Logprobs are the
raw target rows' (as on the plain path); the prefill, and so prompt_logprobs, is never
speculative.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..layers.sampler import SamplingBatch, apply_penalties, processed_probs, token_logprobs
from ..seams import Proposer, Verifier
from ..spec.ngram import ngram_propose
from ..spec.verify import greedy_verify, rejection_sample
from .block_manager import BlockManager
from .kv_cache import KVCache
from .metrics import SpecStats
from .model_runner import ModelRunner, record_logprobs
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


def sampling_rows(seqs: list[Sequence], outputs: list[list[int]], eos_token_ids=()) -> SamplingBatch:
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


def draft_loop(seqs: list[Sequence], budgets: list[int], forward, stats: SpecStats,
               target: ModelRunner | None = None) -> tuple[list[list[int]], list]:
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
            matchers = [_live(seqs[i].grammar) if grammars is not None and not off_grammar[i] else None
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


def _live(matcher):
    """A matcher that can still give a mask: None for no grammar or a terminated one (it accepted EOS; the
    sequence stops there, so the rows after it are never kept)."""
    return matcher if matcher is not None and not matcher.is_terminated() else None


class StatelessProposer:
    """A proposer that keeps nothing per sequence: nothing to trim after a pass, nothing to free."""

    def accepted(self, seq: Sequence, num_before: int, num_kept: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class NgramProposer(StatelessProposer):
    """speculative="ngram": prompt lookup (minillm/spec/ngram.py), no model. `propose_fn(token_ids, k)`
    is the per-sequence lookup (a lab passes the learner's)."""

    def __init__(self, propose_fn=None):
        self.propose_fn = propose_fn or ngram_propose

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[list[int]], list]:
        return [self.propose_fn(seq.token_ids, b) if b else [] for seq, b in zip(seqs, budgets)], [None] * len(seqs)


class SelfDraftProposer(StatelessProposer):
    """speculative="self": the target's first `num_layers` layers, its final norm and its head draft,
    on top of the target's own cache (an early exit, as in LayerSkip)."""

    def __init__(self, runner: ModelRunner, num_layers: int, stats: Callable[[], SpecStats]):
        self.runner, self.num_layers, self.stats = runner, num_layers, stats   # stats(): the run's counters

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[list[int]], list]:
        """Feed each sequence's newest token (the real last one, then each draft)."""
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
            hidden = model(input_ids, positions, meta, num_layers=self.num_layers)
            return model.compute_logits(hidden[torch.tensor(last_rows, dtype=torch.long, device=hidden.device)])

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

    def __init__(self, worker: DraftWorker, stats: Callable[[], SpecStats], target: ModelRunner | None = None):
        self.worker, self.stats, self.target = worker, stats, target   # stats(): the run's counters

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[list[int]], list]:
        """Pass 0 feeds each sequence the tokens its draft state has not cached yet (the whole prompt
        the first time; afterwards the target's last token and any accepted proposals the draft never
        fed); later passes feed the previous proposal."""
        worker = self.worker
        bm = worker.block_manager
        states: dict[int, DraftState] = {}
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

    def accepted(self, seq: Sequence, num_before: int, num_kept: int) -> None:
        """The draft cached the sequence and proposals 1..k-1; what stays valid is the sequence plus
        the accepted proposals among those (the rest is overwritten later)."""
        state = self.worker.states[seq.seq_id]
        state.num_cached_tokens = min(state.num_cached_tokens, num_before + num_kept - 1)
        del state.token_ids[state.num_cached_tokens:]

    def release(self, seq: Sequence) -> None:
        self.worker.release(seq)


def accept_kept(seq: Sequence, tokens: list[int]) -> None:
    """Advance the request's grammar matcher through the kept tokens, as the plain path accepts each sampled
    token (nothing after it has terminated: the sequence stops there). A kept token the grammar refuses is an
    error (a verifier that ignores the target rows?); it is never emitted.

    The engine checks stop conditions after the whole run is appended, and a terminated matcher stops the
    request at every token it checks: so EOS that ends the grammar after other kept tokens is not accepted (the
    EOS rule stops the request at it all the same; with ignore_eos, _stop_at_grammar_ends keeps EOS first)."""
    grammar = seq.grammar
    for i, token in enumerate(tokens):
        if grammar.is_terminated():
            return
        if not grammar.accept_token(token):
            raise RuntimeError(f"request {seq.request_id}: token {token} breaks its grammar (a verifier that keeps "
                               "a token the target's masked row gives probability 0?)")
        if i and grammar.is_terminated() and not seq.params.ignore_eos:
            grammar.rollback(1)
            return


def _stop_at_grammar_ends(seqs: list[Sequence], proposals: list[list[int]], draft_probs: list) -> list[bool]:
    """ignore_eos with a grammar: the grammar's end (EOS) stops such a request only through its terminated
    matcher, which must not be terminated while the engine checks the kept tokens before EOS. So its proposal
    is cut at the first position where the grammar could end (where EOS is allowed), and if every proposal
    before it is kept, the bonus token there is not drawn: EOS can only come as the first token of a step.
    The cut depends on the tokens before that position only, so the output keeps the target's distribution
    (the next step draws that position). Cuts `proposals` / `draft_probs` in place; -> which lose their bonus."""
    no_bonus = [False] * len(seqs)
    for i, seq in enumerate(seqs):
        if seq.grammar is None or not seq.params.ignore_eos or not proposals[i] or seq.grammar.is_terminated():
            continue
        end = _grammar_end(seq.grammar, proposals[i])
        if end is not None:
            proposals[i] = proposals[i][:end]
            if draft_probs[i] is not None:
                draft_probs[i] = draft_probs[i][:end] if end else None
            no_bonus[i] = end > 0
    return no_bonus


def _grammar_end(matcher, proposal: list[int]) -> int | None:
    """The first j in 0..len(proposal) where the matcher, after proposal[:j], could end (is complete); None when
    it cannot before the proposal leaves the grammar or runs out. The matcher is rolled back."""
    advanced = 0
    try:
        for j in range(len(proposal) + 1):
            if matcher.is_completed():
                return j
            if j == len(proposal) or not matcher.accept_token(proposal[j]):
                return None
            advanced += 1
    finally:
        if advanced:
            matcher.rollback(advanced)


class SpecVerifier:
    """Greedy verification and rejection sampling (minillm/spec/verify.py); a lab passes its own functions."""

    def __init__(self, greedy_fn=None, sample_fn=None):
        self.greedy_fn = greedy_fn or greedy_verify
        self.sample_fn = sample_fn or rejection_sample

    def greedy(self, proposal: list[int], target_argmax: list[int]) -> list[int]:
        return self.greedy_fn(proposal, target_argmax)

    def sample(self, proposal: list[int], draft_probs, target_probs, generator) -> list[int]:
        return self.sample_fn(proposal, draft_probs, target_probs, generator=generator)


class Speculator:
    """One speculative decode step for the batch: propose (a Proposer), score every proposal in one
    target pass, keep what the Verifier accepts."""

    def __init__(self, num_speculative_tokens: int, runner: ModelRunner, block_manager, max_model_len: int,
                 proposer: Proposer, verifier: Verifier, stats: Callable[[], SpecStats]):
        self.k = num_speculative_tokens
        self.runner = runner
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.proposer, self.verifier = proposer, verifier
        self.stats = stats   # stats(): the engine's counters of the current run

    def _budget(self, seq: Sequence) -> int:
        """Proposals that can still become output: the last kept token is always the target's own."""
        left_tokens = seq.params.max_tokens - seq.num_output_tokens - 1
        left_context = self.max_model_len - len(seq) - 1
        return max(0, min(self.k, left_tokens, left_context))

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
        proposals, draft_probs = self.proposer.propose(seqs, budgets)
        proposals, draft_probs = list(proposals), list(draft_probs)
        for seq, proposal, budget in zip(seqs, proposals, budgets):
            if len(proposal) > budget:
                raise ValueError(f"proposer {type(self.proposer).__name__} proposed {len(proposal)} tokens for "
                                 f"request {seq.request_id!r}; its budget was {budget} (num_speculative_tokens, "
                                 "max_tokens and max_model_len bound it)")
        no_bonus = _stop_at_grammar_ends(seqs, proposals, draft_probs)
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
        # Process every verified row as the plain sampler would at that position (module docstring, step 3).
        row_seqs, row_outputs = [], []
        for seq, proposal in zip(seqs, proposals):
            output = seq.output_token_ids
            for j in range(len(proposal) + 1):
                row_seqs.append(seq)
                row_outputs.append(output + proposal[:j])
        processed = logits
        grammars = runner.grammars
        if grammars is not None and any(seq.grammar is not None for seq in seqs):
            processed = logits.clone()   # logprobs stay the raw model's
            grammars.apply_proposals(processed, [_live(seq.grammar) for seq in seqs], proposals)
        argmax, probs, sampled = process_rows(processed, sampling_rows(row_seqs, row_outputs, runner.eos_token_ids))
        first_sampled = {r: n for n, r in enumerate(sampled)}
        kept = []
        for i, (seq, proposal, q, (a, b), n_before) in enumerate(zip(seqs, proposals, draft_probs, spans, saved)):
            p = seq.params
            if p.temperature == 0.0:
                tokens = self.verifier.greedy(proposal, argmax[a:b])
            else:
                first = first_sampled[a]   # a sequence's rows are consecutive, in the sampled rows too
                tokens = self.verifier.sample(proposal, q, probs[first:first + b - a], seq.generator)
            accepted = len(tokens) - 1
            if no_bonus[i] and len(tokens) == len(proposal) + 1:
                tokens, accepted = tokens[:-1], len(tokens) - 1   # every proposal kept; the bonus is not drawn
            if seq.grammar is not None:
                accept_kept(seq, tokens)
            recorded = p.recorded_logprobs   # logprobs=N, or best_of's ranking (as on the plain path)
            if recorded is not None:   # row a + j of the target's logits scored the j-th kept token
                record_logprobs([seq] * len(tokens), tokens,
                                token_logprobs(logits[a:a + len(tokens)], tokens, [recorded] * len(tokens)))
            st = self.stats()
            st.num_passes += 1
            st.num_proposed += len(proposal)
            st.num_accepted += accepted
            st.num_emitted += len(tokens)
            kept.append(tokens)
            if proposal:
                self.proposer.accepted(seq, n_before, len(tokens))
        return kept

    def release_finished(self, seqs: list[Sequence]) -> None:
        """Let the proposer free what it holds for finished sequences (a draft model's blocks)."""
        for seq in seqs:
            if seq.is_finished:
                self.proposer.release(seq)
