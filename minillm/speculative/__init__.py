"""Speculative decoding's parts: proposers guess the next tokens cheaply, the verifier keeps what the
target model agrees with (greedy) or what preserves its distribution (sampling).

    ngram.py     ngram_propose + NgramProposer: prompt lookup in the sequence itself, no model
    draft.py     the model drafts: SelfDraftProposer (the target's first layers), DraftModelProposer (a
                 second model), the draft loop, and the sampling rows it shares with the verification
    verify.py    greedy_verify, rejection_sample, residual_distribution + SpecVerifier
    proposer.py  StatelessProposer: the base of proposers that keep nothing per sequence

The engine's speculative step (engine/speculator.py) calls them through the Proposer / Verifier seams
(minillm/seams.py). Nothing here imports minillm.engine: the runner, the draft worker and the
sequences come in as arguments.
"""
