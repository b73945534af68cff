"""RequestOutput / CompletionOutput: what generate() returns, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine.metrics import RequestMetrics


@dataclass
class Logprob:
    """One token's log-probability under the model (raw logits, before sampling settings), as vLLM's."""

    logprob: float
    rank: int                        # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # "stop" | "length" | "abort" | "error" | None while running
    error: str | None = None
    # logprobs=N: one {token id: Logprob} per output token, the sampled token and the N most likely
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)
    # prompt_logprobs=N: None for the first prompt token, then {token id: Logprob} per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @classmethod
    def from_sequence(cls, seq, tokenizer=None) -> "RequestOutput":
        """The request's output: one CompletionOutput per returned continuation (n of them; with best_of > n, the
        n with the highest mean log-probability per output token, best first, indexed 0..n-1)."""
        out = cls(seq.request_id, seq.prompt, list(seq.prompt_token_ids),
                  [completion_output(s, i, tokenizer) for i, s in enumerate(returned_sequences(seq))],
                  seq.group_finished, RequestMetrics.from_sequence(seq))
        if seq.params.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + _logprob_dicts(seq.prompt_logprobs, tokenizer)
        return out


def returned_sequences(seq) -> list:
    """The continuations a request returns: its group, or with best_of > n the n best by mean logprob per token."""
    group, n = seq.group, seq.params.n
    if len(group) <= n:
        return list(group)
    return sorted(group, key=lambda s: -s.cumulative_logprob / max(1, s.num_output_tokens))[:n]


def completion_output(seq, index: int, tokenizer=None) -> CompletionOutput:
    completion = CompletionOutput(index, seq.output_text, list(seq.output_token_ids), seq.finish_reason, seq.error)
    if seq.params.logprobs is not None:
        completion.logprobs = sequence_logprobs(seq, tokenizer)
        completion.cumulative_logprob = seq.cumulative_logprob
    return completion


def sequence_logprobs(seq, tokenizer=None) -> list[dict[int, Logprob]]:
    """A sequence's recorded logprobs as vLLM shapes them: per output token, {id: Logprob}, the sampled token first."""
    return _logprob_dicts(seq.logprobs[:seq.num_output_tokens], tokenizer)


def _logprob_dicts(entries: list, tokenizer=None) -> list[dict[int, Logprob]]:
    def text(token: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token])

    out = []
    for token, logprob, rank, top in entries:
        entry = {token: Logprob(logprob, rank, text(token))}
        for r, (other, other_logprob) in enumerate(top, start=1):
            entry.setdefault(other, Logprob(other_logprob, r, text(other)))
        out.append(entry)
    return out
