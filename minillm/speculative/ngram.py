"""Prompt lookup (n-gram), the proposer without a model: ngram_propose and NgramProposer.

If the last n tokens occurred earlier in the sequence (prompt or output), propose the tokens that
followed them there. Wins when the answer repeats its input: editing, summarising, code changes,
retrieval-augmented answers.

Tries n = max_n down to min_n and takes the most recent earlier match (vLLM's
`prompt_lookup_max` / `prompt_lookup_min`).
"""

from __future__ import annotations

from .proposer import StatelessProposer


def ngram_propose(token_ids: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """token_ids: the sequence so far -> up to k proposed next tokens ([] when nothing matches)."""
    if k < 1:
        raise ValueError(f"num_speculative_tokens={k} must be at least 1")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        # Most recent earlier occurrence whose continuation lies inside the sequence.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == tail:
                follow = token_ids[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer(StatelessProposer):
    """speculative="ngram": prompt lookup (ngram_propose), no model. `propose_fn(token_ids, k)`
    is the per-sequence lookup (a lab passes the learner's)."""

    def __init__(self, propose_fn=None):
        self.propose_fn = propose_fn or ngram_propose

    def propose(self, seqs: list["Sequence"], budgets: list[int]) -> tuple[list[list[int]], list]:
        return [self.propose_fn(seq.token_ids, b) if b else [] for seq, b in zip(seqs, budgets)], [None] * len(seqs)
