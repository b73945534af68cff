"""Sampling: the sampler's distributions against the exact reference, and seeded engine runs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_engine_idle

from minillm import SamplingParams
from minillm.layers.sampler import SamplingBatch, filter_logits
from minillm.layers.sampler import sample as sample_batch


def sample(logits, params, generators):
    """The engine's sampler on rows without history (no penalties apply)."""
    return sample_batch(logits, SamplingBatch(list(params), list(generators)))

N_DRAWS = 20_000

# Distinct values (no ties) so top-k and top-p have one right answer.
LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.7, 1.1, -2.0, 0.8, 0.0, -1.2, 2.6])


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T), restricted to the top-k, then to the nucleus, renormalised (float64)."""
    x = logits.double() / temperature
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))
    keep = order[:top_k] if top_k > 0 else order
    p = torch.zeros_like(x)
    z = sum(math.exp(float(x[i])) for i in keep)
    for i in keep:
        p[i] = math.exp(float(x[i])) / z
    if top_p < 1.0:
        nucleus, mass = [], 0.0
        for i in keep:               # most likely first; stop once the mass reaches top_p
            nucleus.append(i)
            mass += float(p[i])
            if mass >= top_p:
                break
        q = torch.zeros_like(p)
        q[nucleus] = p[nucleus] / p[nucleus].sum()
        p = q
    return p


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    """Counts of n tokens drawn one at a time through the engine's sample() (slow: ~n * 0.3 ms)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(logits), dtype=torch.float64)
    row = logits.unsqueeze(0)
    for _ in range(n):
        counts[sample(row, [params], [gen])[0]] += 1
    return counts


def draw_many(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    """Counts of n tokens drawn at once from the sampler's distribution (filter_logits + softmax)."""
    gen = torch.Generator().manual_seed(seed)
    probs = filter_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)
    ids = torch.multinomial(probs, n, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=len(logits)).double()


def chi2_critical(dof: int, z: float = 4.265) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty), z=4.265 <-> p = 1e-5."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_matches(counts: torch.Tensor, expected: torch.Tensor, max_tv: float = 0.015) -> None:
    n = counts.sum()
    support = expected > 0
    # filtered-out tokens never appear
    assert counts[~support].sum() == 0, f"tokens outside the allowed set were drawn: {counts.tolist()}"
    freq = counts / n
    tv = 0.5 * float((freq - expected).abs().sum())
    assert tv < max_tv, f"total variation {tv:.4f}: drawn {freq.tolist()} vs expected {expected.tolist()}"
    dof = int(support.sum()) - 1
    if dof >= 1:
        e = expected[support] * n
        chi2 = float(((counts[support] - e) ** 2 / e).sum())
        assert chi2 < chi2_critical(dof), f"chi-square {chi2:.1f} with {dof} dof"


CASES = [
    # temperature, top_k, top_p, size of the allowed set
    (1.0, -1, 1.0, 10),
    (0.5, -1, 1.0, 10),
    (2.0, 0, 1.0, 10),
    (1.0, 3, 1.0, 3),
    (0.7, 5, 1.0, 5),
    (1.0, -1, 0.6, None),
    (1.0, -1, 0.9, None),
    (1.3, 6, 0.8, None),
]


@pytest.mark.parametrize("temperature,top_k,top_p,support", CASES)
def test_filter_logits_gives_the_exact_distribution(temperature, top_k, top_p, support):
    got = filter_logits(LOGITS.clone(), temperature, top_k, top_p).double().softmax(-1)
    expected = reference_probs(LOGITS, temperature, top_k, top_p)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    if support is not None:
        assert int((got > 0).sum()) == support


@pytest.mark.parametrize("temperature,top_k,top_p,support", CASES)
def test_sampler_distribution_passes_chi_square(temperature, top_k, top_p, support):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    counts = draw_many(LOGITS, params, N_DRAWS, seed=1234)
    assert counts.sum() == N_DRAWS
    assert_matches(counts, reference_probs(LOGITS, temperature, top_k, top_p))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, -1, 1.0), (1.0, 4, 1.0), (1.3, 6, 0.8)])
def test_sample_draws_from_the_reference_distribution(temperature, top_k, top_p):
    """The engine's sample() itself, one token per call as in a decode step (fewer draws: it is slow)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    counts = draw(LOGITS, params, 3_000, seed=99)
    assert counts.sum() == 3_000
    assert_matches(counts, reference_probs(LOGITS, temperature, top_k, top_p), max_tv=0.04)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    for top_p, kept in [(0.4, 1), (0.5, 1), (0.6, 2), (0.8, 2), (0.81, 3), (0.96, 4)]:
        out = filter_logits(logits, 1.0, -1, top_p)
        assert int(torch.isfinite(out).sum()) == kept, (top_p, out)
        assert torch.isfinite(out[:kept]).all()
    # the most likely token survives even a tiny nucleus
    out = filter_logits(logits, 1.0, -1, 1e-9)
    assert torch.isfinite(out).tolist() == [True, False, False, False]


def test_top_k_and_no_filter():
    out = filter_logits(LOGITS, 1.0, 2, 1.0)
    assert torch.isfinite(out).nonzero().flatten().tolist() == [0, 9]
    # top_k >= vocab, -1 and 0 mean no filter; temperature 1 leaves logits unchanged
    for k in (-1, 0, 10, 50):
        torch.testing.assert_close(filter_logits(LOGITS, 1.0, k, 1.0), LOGITS)
    torch.testing.assert_close(filter_logits(LOGITS, 0.5, -1, 1.0), LOGITS * 2)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(7, 1000)
    params = [SamplingParams(temperature=0.0)] * 7
    assert sample(logits, params, [None] * 7) == logits.argmax(-1).tolist()
    # greedy ignores top-k / top-p and needs no generator
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.3)] * 7
    assert sample(logits, params, [None] * 7) == logits.argmax(-1).tolist()


def test_mixed_batch_rows_are_independent():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    p_greedy, p_k1 = SamplingParams(), SamplingParams(temperature=1.0, top_k=1)
    p_samp = SamplingParams(temperature=1.0)
    out = sample(logits, [p_greedy, p_samp, p_k1], [None, g1, torch.Generator()])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    alone = sample(logits[1:2], [p_samp], [g2])
    assert out[1] == alone[0]


def test_sample_is_reproducible_with_a_seeded_generator():
    params = SamplingParams(temperature=1.0)
    a = [sample(LOGITS[None], [params], [g])[0] for g in [torch.Generator().manual_seed(7)] for _ in range(200)]
    g = torch.Generator().manual_seed(7)
    b = [sample(LOGITS[None], [params], [g])[0] for _ in range(200)]
    assert a == b
    g = torch.Generator().manual_seed(8)
    assert [sample(LOGITS[None], [params], [g])[0] for _ in range(200)] != a


# ------------------------------------------------------------------ seeded runs of the engine

PROMPT = "Write a short poem about the sea:"
OTHERS = ["The capital of France is", "def quicksort(xs):", "Once upon a time, in a small village,"]


def _sp(seed, **kw):
    return SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True, **kw)


def test_seeded_sampling_repeats_exactly(default_llm):
    llm = default_llm
    first = llm.generate(PROMPT, _sp(42))[0].outputs[0].token_ids
    again = llm.generate(PROMPT, _sp(42))[0].outputs[0].token_ids
    assert len(first) == 12
    assert first == again
    # regardless of batch composition and position, and of other seeded or unseeded requests
    prompts = [OTHERS[0], PROMPT, OTHERS[1], PROMPT, OTHERS[2]]
    params = [_sp(1), _sp(42), SamplingParams(temperature=0.8, max_tokens=5), _sp(42), _sp(None)]
    outs = llm.generate(prompts, params)
    assert outs[1].outputs[0].token_ids == first
    assert outs[3].outputs[0].token_ids == first
    # different seeds give different text
    others = [llm.generate(PROMPT, _sp(s))[0].outputs[0].token_ids for s in (1, 2)]
    assert all(o != first for o in others)
    assert others[0] != others[1]
    assert_engine_idle(llm)


def test_top_k_1_and_tiny_top_p_equal_greedy(default_llm):
    greedy = default_llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    outs = default_llm.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True, seed=3),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, ignore_eos=True, seed=4),
    ])
    assert [o.outputs[0].token_ids for o in outs] == [greedy, greedy]


def test_unseeded_requests_get_different_seeds(default_llm):
    """Two unseeded requests in one batch get different seeds (from the engine's generator)."""
    p = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    outs = default_llm.generate([PROMPT, PROMPT], p)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
