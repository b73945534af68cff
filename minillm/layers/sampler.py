"""Sampler: logits -> next token per sequence (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[V] fp32 logits -> temperature-scaled logits with filtered tokens at -inf.

    top-k keeps the k largest; top-p keeps the smallest set of most likely tokens whose
    probability adds up to at least top_p (the most likely token is always kept).
    """
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list, generators: list) -> list[int]:
    """logits: [B, V] fp32, one row per sequence -> B token ids."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    out = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature == 0.0:
            out.append(greedy_ids[row])
            continue
        probs = filter_logits(logits[row], p.temperature, p.top_k, p.top_p).softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out


class TorchSampler:
    """The engine's sampler (the Sampler protocol, minillm/seams.py): greedy rows take the argmax,
    the others draw from the filtered distribution with their request's generator."""

    def sample(self, logits: torch.Tensor, params: list, generators: list) -> list[int]:
        return sample(logits, params, generators)
