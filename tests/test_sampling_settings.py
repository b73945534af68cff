"""The sampling settings of issue 28 (vLLM's names): logit_bias, min_tokens, repetition / frequency / presence
penalties, min_p and logprobs — each against a plain reference, on a batch whose rows use different settings,
and in the engine against transformers (its own repetition penalty, its log-softmax)."""

from __future__ import annotations

import math

import pytest
import torch

from minillm import SamplingParams
from minillm.layers.sampler import SamplingBatch, apply_penalties, filter_batch, filter_logits, processed_probs, sample

VOCAB = 50


def reference_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                        stop_ids: list[int]) -> torch.Tensor:
    """One row, one token at a time, in the documented order (float64)."""
    x = logits.double().clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if len(output) < params.min_tokens:
        for token in stop_ids:
            x[token] = -math.inf
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token in set(output):
        x[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return x


def random_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=gen) * 3
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
    output = torch.randint(0, VOCAB, (int(torch.randint(0, 12, (1,), generator=gen)),), generator=gen).tolist()
    return logits, prompt, output


SETTINGS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.2),
    SamplingParams(logit_bias={3: 5.0, 7: -100}),
    SamplingParams(min_tokens=20, max_tokens=30),
    SamplingParams(repetition_penalty=1.2, presence_penalty=1.5, logit_bias={0: 2.5}, min_tokens=5, max_tokens=8),
]


def test_penalties_match_the_reference_row_by_row_in_one_mixed_batch():
    """Eight rows, eight different settings, one call: each row equals the one-token-at-a-time reference."""
    cases = [random_case(seed) for seed in range(len(SETTINGS))]
    stop = [[1, 2]] * len(SETTINGS)
    batch = SamplingBatch(SETTINGS, [None] * len(SETTINGS), [c[1] for c in cases], [c[2] for c in cases], stop)
    got = apply_penalties(torch.stack([c[0] for c in cases]), batch)
    for i, (params, (logits, prompt, output)) in enumerate(zip(SETTINGS, cases)):
        want = reference_penalties(logits, params, prompt, output, stop[i])
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5, msg=f"row {i}: {params}")


def test_a_batch_without_settings_is_left_alone():
    logits = torch.randn(3, VOCAB)
    batch = SamplingBatch([SamplingParams()] * 3, [None] * 3, [[1, 2]] * 3, [[4, 4]] * 3, [[0]] * 3)
    assert apply_penalties(logits, batch) is logits


def test_min_tokens_bans_stop_ids_only_until_reached():
    logits = torch.zeros(2, VOCAB)
    params = SamplingParams(min_tokens=3, max_tokens=5)
    batch = SamplingBatch([params, params], [None, None], [[5], [5]], [[6, 7], [6, 7, 8]], [[1, 9], [1, 9]])
    out = apply_penalties(logits, batch)
    assert out[0, 1] == out[0, 9] == -math.inf and out[0].isfinite().sum() == VOCAB - 2
    assert out[1].isfinite().all(), "three output tokens reached min_tokens=3: nothing is banned any more"


def test_min_tokens_never_bans_the_last_allowed_tokens():
    """A row where a grammar's mask left only stop tokens (the structure is complete) keeps them: the ban would
    leave nothing to draw; the other rows of the batch are banned as usual."""
    logits = torch.full((2, VOCAB), -math.inf)
    logits[0, 1] = logits[0, 9] = 0.5            # row 0: only the stop ids are allowed
    logits[1, 1] = logits[1, 3] = 0.5            # row 1: a stop id and one other token
    params = SamplingParams(min_tokens=3, max_tokens=5)
    out = apply_penalties(logits, SamplingBatch([params, params], [None, None], [[5], [5]], [[6], [6]],
                                                [[1, 9], [1, 9]]))
    assert out[0, 1] == out[0, 9] == 0.5 and out[0].isfinite().sum() == 2
    assert out[1, 1] == -math.inf and out[1, 3] == 0.5 and out[1].isfinite().sum() == 1


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, -1, 1.0, 0.1), (0.7, 5, 1.0, 0.05), (1.3, -1, 0.8, 0.02), (1.0, 10, 0.9, 0.2), (0.5, 1, 1.0, 0.0)])
def test_filters_match_a_plain_reference(temperature, top_k, top_p, min_p):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    x = logits.double() / temperature
    p = x.softmax(-1)
    keep = p >= min_p * p.max()                                   # min_p first
    order = sorted(range(VOCAB), key=lambda i: -float(x[i]))
    ranked = [i for i in order if keep[i]]
    if top_k > 0:
        ranked = ranked[:top_k]
    if top_p < 1.0:
        q = torch.zeros_like(p)
        q[ranked] = p[ranked] / p[ranked].sum()
        nucleus, mass = [], 0.0
        for i in ranked:
            nucleus.append(i)
            mass += float(q[i])
            if mass >= top_p:
                break
        ranked = nucleus
    got = filter_logits(logits, temperature, top_k, top_p, min_p)
    assert sorted(torch.nonzero(got.isfinite()).flatten().tolist()) == sorted(ranked)


def test_a_mixed_batch_filters_each_row_as_alone():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    settings = [(1.0, -1, 1.0, 0.0), (0.6, 4, 1.0, 0.0), (1.4, -1, 0.7, 0.0), (1.0, 8, 0.95, 0.1)]
    batched = filter_batch(logits, *(torch.tensor(col) for col in zip(*settings)))
    for row, (t, k, p, m) in enumerate(settings):
        torch.testing.assert_close(batched[row], filter_logits(logits[row], t, k, p, m))


def test_a_top_p_of_1_keeps_the_tail_beside_a_row_that_filters():
    # one dominant logit: in fp32 the running sum reaches exactly 1.0 after it, so a threshold of 1.0 applied to
    # every row would drop this row's whole tail although its top_p = 1 means "off"
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 30.0
    batched = filter_batch(logits, torch.ones(2), torch.tensor([-1, -1]), torch.tensor([1.0, 0.5]), torch.zeros(2))
    assert bool(batched[0].isfinite().all()), "the top_p = 1 row lost tokens"
    assert int(batched[1].isfinite().sum()) == 1


def test_seeded_sampling_with_penalties_repeats_batched_or_alone():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(temperature=0.9, repetition_penalty=1.4, seed=1),
              SamplingParams(temperature=1.1, frequency_penalty=0.5, min_p=0.05, seed=2),
              SamplingParams(temperature=0.0, presence_penalty=1.0)]
    prompts, outputs = [[1, 2, 3], [4, 4], [5]], [[6], [7, 7, 8], [9, 9]]

    def run(rows):
        gens = [torch.Generator().manual_seed(params[r].seed) if params[r].seed is not None else None for r in rows]
        batch = SamplingBatch([params[r] for r in rows], gens, [prompts[r] for r in rows], [outputs[r] for r in rows])
        return [sample(logits[rows], batch) for _ in range(1)][0]

    together = run([0, 1, 2])
    assert together == [run([0])[0], run([1])[0], run([2])[0]]


def test_sampling_follows_the_processed_distribution():
    """Chi-square over 20,000 draws: the sampler draws from processed_probs (penalties, then the filters)."""
    logits = torch.tensor([2.0, 1.5, 0.3, -0.7, 1.1, -2.0, 0.8, 0.0, -1.2, 2.6])
    params = SamplingParams(temperature=0.8, top_k=6, min_p=0.05, repetition_penalty=1.5, frequency_penalty=0.3,
                            logit_bias={5: 3.0}, seed=0)
    batch = SamplingBatch([params], [torch.Generator().manual_seed(0)], [[9, 0]], [[0, 0, 4]])
    probs = processed_probs(logits[None], batch)[0].double()
    counts = torch.zeros(10, dtype=torch.float64)
    n = 20_000
    for _ in range(n):
        counts[sample(logits[None], batch)[0]] += 1
    support = probs > 0
    assert counts[~support].sum() == 0, "a filtered token was drawn"
    expected = probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), f"chi-square {chi2:.1f} with {dof} degrees of freedom"


@pytest.mark.parametrize("kwargs, message", [
    ({"min_p": 1.5}, r"min_p=1.5 must be in \[0, 1\]"),
    ({"presence_penalty": 3}, r"presence_penalty=3 must be in \[-2, 2\]"),
    ({"frequency_penalty": -2.5}, r"frequency_penalty=-2.5 must be in \[-2, 2\]"),
    ({"repetition_penalty": 0}, r"repetition_penalty=0 must be in \(0, 10\]"),
    ({"logit_bias": {"x": 1}}, r"keys must be token ids"),
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\]=101 must be in \[-100, 100\]"),
    ({"min_tokens": 9, "max_tokens": 4}, r"min_tokens=9 must be an integer in \[0, max_tokens=4\]"),
    ({"logprobs": 21}, r"logprobs=21 must be None \(off\) or an integer in \[0, 20\]"),
    ({"logprobs": -1}, r"logprobs=-1"),
])
def test_bad_settings_name_the_value_and_the_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_keys_from_json_become_ints():
    assert SamplingParams(logit_bias={"17": -100}).logit_bias == {17: -100}


# ------------------------------------------------------------------ the engine
PROMPT = "The three primary colours are"


def test_logprobs_of_greedy_tokens_equal_transformers_log_softmax(default_llm, hf_default):
    out = default_llm.generate(PROMPT, SamplingParams(max_tokens=8, logprobs=5, ignore_eos=True))[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids
    with torch.inference_mode():
        ref = hf_default(torch.tensor([ids + completion.token_ids])).logits[0].float().log_softmax(-1)
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    total = 0.0
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(ids) - 1 + j]
        assert entry[token].rank == 1, "greedy picks the most likely token"
        assert abs(entry[token].logprob - float(row[token])) < 1e-4
        top = row.topk(5)
        assert list(entry) [:1] == [token] and set(entry) == set(top.indices.tolist())
        for other, value in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[other].logprob - value) < 1e-4
        assert entry[token].decoded_token == default_llm.tokenizer.decode([token])
        total += entry[token].logprob
    assert abs(completion.cumulative_logprob - total) < 1e-6


def test_repetition_penalty_matches_transformers_generate(default_llm, hf_default):
    """transformers' RepetitionPenaltyLogitsProcessor is the same rule (prompt and output tokens, / or x r)."""
    ids = default_llm.tokenizer.encode("List the days of the week: Monday, Tuesday,")
    mine = default_llm.generate({"prompt_token_ids": ids},
                                SamplingParams(max_tokens=12, repetition_penalty=1.3, ignore_eos=True))[0]
    with torch.inference_mode():
        ref = hf_default.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=12, min_new_tokens=12, do_sample=False, repetition_penalty=1.3)
    assert mine.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_presence_and_frequency_penalties_match_a_greedy_loop_on_transformers(default_llm, hf_default):
    ids = default_llm.tokenizer.encode("Repeat after me: cat cat cat cat")
    params = SamplingParams(max_tokens=10, presence_penalty=0.8, frequency_penalty=0.6, ignore_eos=True)
    mine = default_llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    tokens = list(ids)
    with torch.inference_mode():
        for _ in range(10):
            logits = hf_default(torch.tensor([tokens])).logits[0, -1].float()
            output = tokens[len(ids):]
            tokens.append(int(reference_penalties(logits, params, ids, output, []).argmax()))
    assert mine == tokens[len(ids):]


def test_logit_bias_and_min_tokens_in_the_engine(default_llm):
    eos = sorted(default_llm.engine.eos_token_ids)[0]
    forced = default_llm.generate(PROMPT, SamplingParams(max_tokens=4, logit_bias={42: 100}, ignore_eos=True))[0]
    assert forced.outputs[0].token_ids == [42, 42, 42, 42]
    # EOS pushed to the top, but banned for the first 3 tokens: 3 tokens, then EOS ends the request
    out = default_llm.generate(PROMPT, SamplingParams(max_tokens=10, min_tokens=3, logit_bias={eos: 100}))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and eos not in out.token_ids[:3]
    assert out.finish_reason == "stop"


def test_min_tokens_ignores_stop_strings_until_reached(default_llm):
    greedy = default_llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    first_word = greedy.text.split()[0]
    stopped = default_llm.generate(PROMPT, SamplingParams(max_tokens=6, stop=[first_word], ignore_eos=True))[0].outputs[0]
    assert stopped.finish_reason == "stop" and first_word not in stopped.text
    late = default_llm.generate(PROMPT, SamplingParams(max_tokens=6, stop=[first_word], min_tokens=6,
                                                       ignore_eos=True))[0].outputs[0]
    assert late.token_ids == greedy.token_ids and late.finish_reason == "length"


def test_a_bad_logit_bias_token_is_refused_and_the_engine_serves_on(default_llm):
    vocab = default_llm.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids \[{vocab}\] are outside the vocabulary range"):
        default_llm.generate(PROMPT, SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    assert default_llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("levers", [{}, {"chunked_prefill": True, "max_num_batched_tokens": 8, "prefix_caching": True}],
                         ids=["whole-prefill", "chunks-of-8-prefix-cache"])
def test_prompt_logprobs_equal_transformers_log_softmax(default_llm, hf_default, levers):
    """Every prompt token after the first, also when the prompt is read in chunks of 8 and a prefix cache holds the
    same prompt (a request that wants prompt logprobs computes every token: cached ones would have no logits)."""
    llm = default_llm.with_levers(**levers) if levers else default_llm
    prompt = "Evaluation harnesses score a prompt with the model's own log-probabilities, token by token."
    if levers:
        llm.generate(prompt, SamplingParams(max_tokens=1))   # the prompt's blocks now sit in the prefix cache
    out = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=3, logprobs=1))[0]
    ids = out.prompt_token_ids
    with torch.inference_mode():
        ref = hf_default(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids) > 16
    for position in range(1, len(ids)):
        entry, row = out.prompt_logprobs[position], ref[position - 1]
        token = ids[position]
        assert abs(entry[token].logprob - float(row[token])) < 1e-4, position
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert set(row.topk(3).indices.tolist()) <= set(entry)
    assert out.outputs[0].logprobs is not None and len(out.outputs[0].logprobs) == 2


def test_logprobs_with_speculative_decoding_equal_the_plain_engines(default_llm):
    """Speculation keeps the target's own tokens (greedy) and scores each kept token with the target's logits row
    that verified it: the same logprobs as one token per step."""
    prompt = "one two three one two three one two three one two"
    params = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)
    plain = default_llm.generate(prompt, params)[0].outputs[0]
    spec = default_llm.with_levers(speculative="ngram", num_speculative_tokens=3)
    fast = spec.generate(prompt, params)[0].outputs[0]
    assert spec.engine.speculator.stats().num_accepted > 0, "the repeating prompt lets n-gram proposals through"
    assert fast.token_ids == plain.token_ids and len(fast.logprobs) == len(plain.logprobs) == 12
    for a, b in zip(fast.logprobs, plain.logprobs):
        assert list(a) == list(b)
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
