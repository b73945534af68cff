"""Sampler: a batch of next-token logits -> one token per sequence, every setting of SamplingParams applied
on the whole batch at once (rows with different settings side by side), in vLLM's order:

1. ``logit_bias``: added to the listed tokens' logits;
2. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` banned (-inf) until the sequence has
   ``min_tokens`` output tokens (except in a row where nothing else is left: a structured output whose grammar
   is complete allows only EOS, and ends there);
3. penalties on the biased logits: ``repetition_penalty`` r on every token of the prompt or the output (a positive
   logit divided by r, a negative one multiplied: HF / vLLM / CTRL), then ``frequency_penalty`` f and
   ``presence_penalty`` p on the output tokens: ``logit -= f * count + p * (count > 0)`` (OpenAI's formula);
4. ``temperature == 0``: the argmax of the logits so far (greedy still sees biases, bans and penalties);
5. otherwise ``logits / temperature``, then ``min_p`` (drop tokens whose probability is below min_p times the
   most likely one's), ``top_k`` (keep the k largest), ``top_p`` (keep the smallest set of most likely tokens whose
   probability reaches top_p; the most likely token always stays), and one draw per row from the row's own
   ``torch.Generator`` (so a seeded request draws the same tokens batched or alone).

Speculative decoding (minillm/engine/speculator.py) verifies against the same processing: one SamplingBatch row per
verified position, its output history extended by the proposals before it, through :func:`apply_penalties` (greedy)
and :func:`processed_probs` (sampled); its model drafts draw from the same processing of the draft's logits.

The model's log-probabilities that ``logprobs=N`` returns are taken from the raw logits, before any of this
(vLLM's default, and what OpenAI's ``logprobs`` report): :func:`token_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """What the sampler knows about each row of a logits batch: its request's SamplingParams, its generator
    (None for greedy), the prompt and the output so far (for penalties and min_tokens), and the token ids that
    end it (EOS unless ignore_eos, plus stop_token_ids: banned until min_tokens)."""

    params: list
    generators: list
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    stop_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.params)
        self.prompt_token_ids = self.prompt_token_ids or [[] for _ in range(n)]
        self.output_token_ids = self.output_token_ids or [[] for _ in range(n)]
        self.stop_token_ids = self.stop_token_ids or [[] for _ in range(n)]
        rows = (len(self.generators), len(self.prompt_token_ids), len(self.output_token_ids), len(self.stop_token_ids))
        if any(r != n for r in rows):
            raise ValueError(f"a SamplingBatch needs one entry per row: {n} params, {rows[0]} generators, "
                             f"{rows[1]} prompts, {rows[2]} outputs, {rows[3]} stop-id lists")

    @classmethod
    def from_sequences(cls, seqs: list, eos_token_ids=()) -> "SamplingBatch":
        eos = list(eos_token_ids)
        return cls([s.params for s in seqs], [s.generator for s in seqs],
                   [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                   [([] if s.params.ignore_eos else eos) + list(s.params.stop_token_ids) for s in seqs])

    def __len__(self) -> int:
        return len(self.params)


# ------------------------------------------------------------------ 1-3: biases, bans, penalties
def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] fp32 logits -> the same with logit_bias, min_tokens bans and the three penalties applied (a new
    tensor when anything applies; the input itself when no row asks for any)."""
    params = batch.params
    rows_bias = [i for i, p in enumerate(params) if p.logit_bias]
    rows_ban = [i for i, p in enumerate(params)
                if p.min_tokens and len(batch.output_token_ids[i]) < p.min_tokens and batch.stop_token_ids[i]]
    rows_rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    rows_freq = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if not (rows_bias or rows_ban or rows_rep or rows_freq):
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    if rows_bias:
        r, t, v = zip(*[(i, int(tok), float(b)) for i in rows_bias for tok, b in params[i].logit_bias.items()])
        logits.index_put_((torch.tensor(r, device=device), torch.tensor(t, device=device)),
                          torch.tensor(v, device=device, dtype=logits.dtype), accumulate=True)
    if rows_ban:
        r, t = zip(*[(i, tok) for i in rows_ban for tok in batch.stop_token_ids[i] if 0 <= tok < vocab])
        where = (torch.tensor(r, device=device), torch.tensor(t, device=device))
        before = logits[where]
        logits[where] = NEG_INF
        # a row the ban would leave with no token at all (a grammar allows only EOS: its structure is complete)
        # keeps its stop tokens: the constraint ends the request, min_tokens cannot extend it
        emptied = torch.isneginf(logits[list(rows_ban)]).all(-1)
        if bool(emptied.any()):
            keep = emptied[torch.tensor([rows_ban.index(i) for i in r], device=device)]
            logits[where] = torch.where(keep, before, logits[where])
    if rows_rep:
        seen = _token_counts(logits, rows_rep, [batch.prompt_token_ids[i] + batch.output_token_ids[i] for i in rows_rep]) > 0
        penalty = torch.tensor([params[i].repetition_penalty for i in rows_rep], device=device).unsqueeze(1)
        sub = logits[rows_rep]
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        logits[rows_rep] = sub
    if rows_freq:
        counts = _token_counts(logits, rows_freq, [batch.output_token_ids[i] for i in rows_freq])
        freq = torch.tensor([params[i].frequency_penalty for i in rows_freq], device=device).unsqueeze(1)
        pres = torch.tensor([params[i].presence_penalty for i in rows_freq], device=device).unsqueeze(1)
        logits[rows_freq] -= freq * counts + pres * (counts > 0).to(logits.dtype)
    return logits


def _token_counts(logits: torch.Tensor, rows: list[int], histories: list[list[int]]) -> torch.Tensor:
    """[len(rows), V] counts of each token in each row's history (one scatter_add over padded ids)."""
    vocab = logits.shape[-1]
    width = max((len(h) for h in histories), default=0)
    ids = torch.full((len(rows), max(width, 1)), vocab, dtype=torch.long)   # pad with a column past the vocab
    for j, history in enumerate(histories):
        if history:
            ids[j, :len(history)] = torch.tensor(history, dtype=torch.long)
    counts = torch.zeros(len(rows), vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, ids.to(logits.device), torch.ones_like(ids, dtype=logits.dtype, device=logits.device))
    return counts[:, :vocab]


# ------------------------------------------------------------------ 5: temperature and the filters
def filter_batch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """[B, V] logits and [B] settings -> temperature-scaled logits with filtered tokens at -inf.

    temperature > 0 per row; top_k <= 0 or >= V: off; top_p = 1: off; min_p = 0: off."""
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[-1]
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, NEG_INF)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if bool(use_k.any()):
            k = torch.where(use_k, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
            rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
            # ties with the k-th value stay, as with a threshold on the k-th largest logit
            kth = sorted_logits.gather(1, (k - 1).clamp(max=vocab - 1))
            drop |= (rank >= k) & (sorted_logits < kth)
        if bool(use_p.any()):
            probs = sorted_logits.masked_fill(drop, NEG_INF).softmax(-1)
            mass_before = probs.cumsum(-1) - probs
            # only the rows with top_p < 1: a row with top_p = 1 keeps the tail whose running sum rounds to 1.0
            drop |= (mass_before >= top_p.unsqueeze(1)) & use_p.unsqueeze(1)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)
    return logits


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """One row ([V]) or a batch ([B, V]) with one setting -> temperature-scaled logits, filtered tokens at -inf
    (tests and labs use it; the engine's paths go through processed_probs / sample)."""
    rows = logits if logits.dim() == 2 else logits.unsqueeze(0)
    b, dev = rows.shape[0], rows.device
    out = filter_batch(rows, torch.full((b,), float(temperature), device=dev), torch.full((b,), int(top_k), device=dev),
                       torch.full((b,), float(top_p), device=dev), torch.full((b,), float(min_p), device=dev))
    return out if logits.dim() == 2 else out[0]


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each sampled row draws from: [B, V] probabilities after steps 1-5 (rows that are greedy
    get a one-hot on their argmax)."""
    logits = apply_penalties(logits, batch)
    probs = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(batch.params) if p.temperature == 0.0]
    sampled = [i for i, p in enumerate(batch.params) if p.temperature != 0.0]
    if greedy:
        probs[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(-1), logits.shape[-1]).to(probs.dtype)
    if sampled:
        probs[sampled] = _filtered(logits[sampled], [batch.params[i] for i in sampled]).softmax(-1)
    return probs


def _filtered(logits: torch.Tensor, params: list) -> torch.Tensor:
    dev = logits.device
    return filter_batch(logits, torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype),
                        torch.tensor([p.top_k for p in params], device=dev),
                        torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype),
                        torch.tensor([p.min_p for p in params], device=dev, dtype=logits.dtype))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    """logits: [B, V] fp32, one row per sequence -> B token ids."""
    logits = apply_penalties(logits, batch)
    out = logits.argmax(dim=-1).tolist()
    sampled = [i for i, p in enumerate(batch.params) if p.temperature != 0.0]
    if sampled:
        probs = _filtered(logits[sampled], [batch.params[i] for i in sampled]).softmax(-1)
        for j, row in enumerate(sampled):
            out[row] = int(torch.multinomial(probs[j], 1, generator=batch.generators[row]).item())
    return out


# ------------------------------------------------------------------ logprobs (from the raw logits)
def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int | None]) -> list:
    """For each row whose num_top is not None: (the chosen token's log-probability, its rank (1 = most likely),
    [(token, logprob), ...] of the num_top most likely tokens); None for the other rows. From the raw logits."""
    rows = [i for i, n in enumerate(num_top) if n is not None]
    out: list = [None] * len(token_ids)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = torch.tensor([token_ids[i] for i in rows], device=logits.device)
    chosen_logp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logp > chosen_logp.unsqueeze(1)).sum(-1) + 1
    k = max(num_top[i] for i in rows)
    top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    chosen_logp, ranks, top_vals, top_ids = (t.tolist() for t in (chosen_logp, ranks, top_vals, top_ids))
    for j, i in enumerate(rows):
        n = num_top[i]
        out[i] = (chosen_logp[j], ranks[j], list(zip(top_ids[j][:n], top_vals[j][:n])))
    return out


class TorchSampler:
    """The engine's sampler (the Sampler protocol, minillm/seams.py): every setting of the batch applied in
    vLLM's order (module docstring), greedy rows take the argmax, the others draw with their own generator."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
        return sample(logits, batch)
