"""The verifier (greedy_verify, rejection_sample, SpecVerifier): which of k proposed tokens to keep.

Given k proposed tokens and the target's scores at all k + 1 positions (one target pass), decide
which tokens to keep.

Greedy (temperature 0): keep the longest prefix of the proposal that equals the target's own
argmax, then the target's argmax at the first disagreement (or after the last proposal, the
bonus token). The output equals what the target alone would have produced, token for token.

Sampling (temperature > 0), Leviathan et al. 2023 / Chen et al. 2023: proposal x_i drawn from
the draft's q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection a replacement is drawn from normalize(max(p_i - q_i, 0)) and the round ends; when
all k are accepted a bonus token is drawn from p_k. Each emitted token is distributed exactly
as the target's p at its position, whatever q is (q only changes how many are accepted).

Shapes: proposal [k] token ids; draft_probs [k, V]; target_probs [k + 1, V] (rows sum to 1).
A deterministic proposer (n-gram lookup, greedy draft) puts all its mass on its token: pass
draft_probs=None and q_i(x_i) = 1 is used.
"""

from __future__ import annotations

import torch


def greedy_verify(proposal: list[int], target_argmax: list[int]) -> list[int]:
    """proposal [k], target_argmax [k + 1] -> the tokens to append (1 to k + 1 of them)."""
    if len(target_argmax) != len(proposal) + 1:
        raise ValueError(f"target_argmax has {len(target_argmax)} entries; a proposal of {len(proposal)} "
                         f"tokens needs {len(proposal) + 1} (one per proposed position plus the bonus)")
    out = []
    for drafted, target in zip(proposal, target_argmax):
        out.append(target)
        if drafted != target:
            return out
    out.append(target_argmax[-1])
    return out


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) [V]; falls back to p where p <= q everywhere (then p == q and a
    rejection cannot happen, but rounding can make the residual all zeros)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def rejection_sample(proposal: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """proposal [k], draft_probs [k, V] or None (deterministic proposer), target_probs [k + 1, V]
    -> the tokens to append (1 to k + 1 of them), each distributed as the target's."""
    k = len(proposal)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}; a proposal of {k} tokens "
                         f"needs [{k + 1}, vocab]")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}; expected [{k}, {target_probs.shape[1]}]")
    device = target_probs.device
    uniforms = torch.rand(k, generator=generator, device=device) if k else None
    out: list[int] = []
    for i, x in enumerate(proposal):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[i]
        qx = q[x].item()
        accept = qx > 0 and uniforms[i].item() < min(1.0, p[x].item() / qx)
        if accept:
            out.append(x)
            continue
        residual = residual_distribution(p.float(), q.float())
        out.append(int(torch.multinomial(residual, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(target_probs[k].float(), 1, generator=generator).item()))
    return out


class SpecVerifier:
    """Greedy verification and rejection sampling (greedy_verify, rejection_sample); a lab passes its own functions."""

    def __init__(self, greedy_fn=None, sample_fn=None):
        self.greedy_fn = greedy_fn or greedy_verify
        self.sample_fn = sample_fn or rejection_sample

    def greedy(self, proposal: list[int], target_argmax: list[int]) -> list[int]:
        return self.greedy_fn(proposal, target_argmax)

    def sample(self, proposal: list[int], draft_probs, target_probs, generator) -> list[int]:
        return self.sample_fn(proposal, draft_probs, target_probs, generator=generator)
