"""Speculative decoding in the engine's decode steps (`speculative=`): the Speculator's step, the DraftWorker.

One speculative step, for every decoding sequence of the batch at once:

1. propose up to k = `num_speculative_tokens` next tokens per sequence with a Proposer
   (minillm/speculative/): "ngram" looks them up in the sequence itself (speculative/ngram.py, no
   model); "self" runs the target's first `draft_num_layers` layers as an early exit, on the
   target's own cache; "draft" runs a second, smaller model (`draft_model`, same tokenizer) with
   its own KV pool and block tables (DraftWorker, below); both in speculative/draft.py;
2. one target pass scores all of them: each sequence feeds its last token plus its proposals
   as a short extend chunk (the same path as a chunked prefill over the paged cache), and the
   logits of all k + 1 positions come back;
3. verify (a Verifier, speculative/verify.py) against the distribution the plain engine would
   sample from, not the raw logits: row j of a sequence's k + 1 rows is processed as if
   proposals[:j] had been emitted (one SamplingBatch row per position, the output so far plus
   proposals[:j], through the sampler's own apply_penalties / processed_probs, all rows in one
   call, speculative/draft.py's sampling_rows / process_rows): structured output's
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
logits (speculative/draft.py): the closer q is to the target's p, the more proposals are kept.
Losslessness only needs each proposal to be drawn from the q handed to the verifier (or to be
deterministic, with q = None).

A sequence whose proposal is empty, or whose extra blocks do not fit, takes a plain one-token
step inside the same pass. Proposals never run past max_tokens or max_model_len. Logprobs are the
raw target rows' (as on the plain path); the prefill, and so prompt_logprobs, is never
speculative.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..layers.sampler import token_logprobs
from ..seams import BatchVerifier, Proposer, Verifier, conforms
from ..speculative.draft import live_matcher, process_rows, sampling_rows
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
            hidden = runner.forward(input_ids, positions, meta)
            rows, spans = [], []
            for proposal, last in zip(proposals, last_rows):
                first = last - len(proposal)
                spans.append((len(rows), len(rows) + len(proposal) + 1))
                rows.extend(range(first, last + 1))
            if len(rows) != hidden.shape[0]:
                hidden = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
            logits = runner.compute_logits(hidden)   # [sum(k_i + 1), vocab] fp32
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
            grammars.apply_proposals(processed, [live_matcher(seq.grammar) for seq in seqs], proposals)
        argmax, probs, sampled = process_rows(processed, sampling_rows(row_seqs, row_outputs, runner.eos_token_ids))
        first_sampled = {r: n for n, r in enumerate(sampled)}
        batched = self._greedy_batch(seqs, proposals, argmax, spans)
        kept = []
        for i, (seq, proposal, q, (a, b), n_before) in enumerate(zip(seqs, proposals, draft_probs, spans, saved)):
            p = seq.params
            if i in batched:
                tokens = batched[i]
            elif p.temperature == 0.0:
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

    def _greedy_batch(self, seqs: list[Sequence], proposals: list[list[int]], argmax, spans) -> dict[int, list[int]]:
        """A BatchVerifier's tokens for every greedy sequence of the step, from one call (seams.BatchVerifier)."""
        if not conforms(self.verifier, BatchVerifier):
            return {}
        rows = [i for i, seq in enumerate(seqs) if seq.params.temperature == 0.0]
        if not rows:
            return {}
        got = list(self.verifier.greedy_batch([list(proposals[i]) for i in rows],
                                              [list(argmax[spans[i][0]:spans[i][1]]) for i in rows]))
        if len(got) != len(rows):
            raise ValueError(f"verifier {type(self.verifier).__name__}.greedy_batch returned {len(got)} results "
                             f"for {len(rows)} sequences")
        out = {}
        for i, tokens in zip(rows, got):
            tokens = [int(t) for t in tokens]
            if not 1 <= len(tokens) <= len(proposals[i]) + 1:
                raise ValueError(f"verifier {type(self.verifier).__name__}.greedy_batch kept {len(tokens)} tokens "
                                 f"of a {len(proposals[i])}-token proposal; 1 to {len(proposals[i]) + 1} are possible")
            out[i] = tokens
        return out

    def release_finished(self, seqs: list[Sequence]) -> None:
        """Let the proposer free what it holds for finished sequences (a draft model's blocks)."""
        for seq in seqs:
            if seq.is_finished:
                self.proposer.release(seq)
