"""Speculative decoding in the engine (speculative="ngram" / "self" / "draft"): greedy output equals the target
alone, token for token, at batch 1 and batched, under every batching / paging / chunking /
prefix-caching lever and under preemption; sampled output keeps the target's distribution
(chi-square); proposals never overrun max_tokens or stop conditions; every block returns."""

import itertools
import random

import pytest
import torch

import kernel_utils  # noqa: F401  first: picks the Triton interpreter before triton is imported
from conftest import assert_engine_idle, chi_square_p_value

from minillm import LLM, EngineConfig, SamplingParams
from minillm.engine.sequence import Sequence

_rng = random.Random(5)
# Prompts that repeat a short pattern (so the n-gram proposer finds matches), of 3 to 60 tokens,
# and outputs of 1 to 40 tokens; a random model's greedy output also falls into loops.
PROMPTS = []
for _ in range(24):
    pattern = [_rng.randrange(3, 500) for _ in range(_rng.randrange(2, 9))]
    PROMPTS.append((pattern * 20)[:_rng.randrange(3, 61)])
PARAMS = [SamplingParams(max_tokens=_rng.randrange(1, 41), ignore_eos=True) for _ in PROMPTS]


@pytest.fixture(scope="module")
def target_tokens():
    llm = LLM("random:tiny-llama", max_model_len=256, max_num_seqs=1)
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)]


def _run(levers):
    levers = {"speculative": "ngram", **levers}
    llm = LLM("random:tiny-llama", max_model_len=256, **levers)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


COMBOS = [dict(batching=b, paged=p, chunked_prefill=c, num_speculative_tokens=k)
          for b, p, c, k in itertools.product(["continuous", "static"], [True, False], [False, True], [1, 4])]


@pytest.mark.parametrize("levers", COMBOS, ids=lambda d: "-".join(str(v) for v in d.values()))
def test_greedy_speculation_equals_the_target_alone(target_tokens, levers):
    llm, tokens = _run(levers)
    assert tokens == target_tokens
    spec = llm.stats.spec
    # the test exercises both outcomes of verification, not only one
    assert spec.num_proposed > 0 and 0 < spec.num_accepted < spec.num_proposed, spec
    assert spec.num_emitted == spec.num_passes + spec.num_accepted
    assert_engine_idle(llm)


@pytest.mark.parametrize("levers", [
    dict(max_num_seqs=1),                                           # batch 1
    dict(prefix_caching=True),                                      # blocks shared with the cache
    dict(kv_cache_bytes=12 * 16 * 2 * 2 * 2 * 16 * 4, block_size=16),  # 12 blocks: preemption
    pytest.param(dict(attention_backend="triton", num_speculative_tokens=3),   # the extend kernel verifies
                 marks=pytest.mark.slow),   # 80-160 s in the interpreter; test-slow runs it
    dict(speculative="self", draft_num_layers=1),                   # early-exit draft: 1 of 2 layers
    dict(speculative="self", draft_num_layers=1, max_num_seqs=1, num_speculative_tokens=2),
    pytest.param(dict(speculative="self", draft_num_layers=1, attention_backend="triton", chunked_prefill=True),
                 marks=pytest.mark.slow),
])
def test_greedy_speculation_under_other_levers(target_tokens, levers):
    llm, tokens = _run(levers)
    assert tokens == target_tokens
    assert llm.stats.spec.num_accepted > 0
    if "kv_cache_bytes" in levers:
        assert llm.stats.num_preemptions > 0
    assert_engine_idle(llm)


def test_stop_tokens_inside_the_kept_run_end_the_sequence_there(target_tokens):
    # stop at a token that the target emits mid-output: the kept run is cut at it
    i = max(range(len(PROMPTS)), key=lambda j: len(target_tokens[j]))
    stop = target_tokens[i][len(target_tokens[i]) // 2]
    params = SamplingParams(max_tokens=40, stop_token_ids=[stop])
    plain = LLM("random:tiny-llama", max_model_len=256)
    spec = plain.with_levers(speculative="ngram", num_speculative_tokens=6)
    a = plain.generate([{"prompt_token_ids": PROMPTS[i]}], params, use_tqdm=False)[0].outputs[0]
    b = spec.generate([{"prompt_token_ids": PROMPTS[i]}], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"
    assert b.token_ids[-1] == stop and stop not in b.token_ids[:-1]
    assert_engine_idle(spec)


def test_proposals_never_overrun_max_tokens():
    llm = LLM("random:tiny-llama", max_model_len=256, speculative="ngram", num_speculative_tokens=8)
    outs = llm.generate([{"prompt_token_ids": [7, 8, 9] * 10}] * 3,
                        [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 2, 9)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 9]
    # one arrival time per output token (kept tokens of one pass arrive together: gaps of 0)
    assert [len(o.metrics.itl_s) for o in outs] == [0, 1, 8]
    assert_engine_idle(llm)


def _target_probs(llm, tokens):
    """The target's next-token distribution after `tokens` (temperature 1, top-k 6)."""
    from minillm.layers.sampler import filter_logits

    logits = llm.engine.runner.logits([Sequence(list(tokens), SamplingParams())])[0]
    return filter_logits(logits, 1.0, 6, 1.0).softmax(-1).double()


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_sampled_speculation_keeps_the_target_distribution(monkeypatch, method):
    """The second output token's distribution given the first, with speculation, against the
    target's own next-token distribution (temperature 1, top-k 6), by a chi-square test. The
    proposer is pinned to a plausible token (the target's second choice), so verification both
    accepts (min(1, p/q) with q a point mass) and rejects (resampling from the residual). The
    "self" proposer samples its proposals from its own distribution q (the first layer); "draft"
    from a perturbed copy of the target."""
    import minillm.speculative.ngram as speculative

    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    ref = LLM("random:tiny-llama", max_model_len=64, kv_cache=False)
    first = int(_target_probs(ref, prompt).argmax())
    p = _target_probs(ref, prompt + [first])
    proposal = int(p.topk(2).indices[1])
    if method == "ngram":
        monkeypatch.setattr(speculative, "ngram_propose", lambda token_ids, k: [proposal] * k)

    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(1500)]
    extra = dict(draft_model="random:tiny-llama") if method == "draft" else {}
    llm = LLM("random:tiny-llama", max_model_len=64, max_num_seqs=256, speculative=method, num_speculative_tokens=1,
              **extra)
    if method == "draft":
        perturb_draft(llm, 0.5)
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * len(params), params,
                                                         use_tqdm=False)]
    spec = llm.stats.spec
    assert 0 < spec.num_accepted < spec.num_proposed, spec
    seconds = [o[1] for o in outs if o[0] == first]
    assert len(seconds) > 150   # 240 with these seeds
    counts = torch.bincount(torch.tensor(seconds), minlength=p.numel()).double()
    keep = p > 0
    assert counts[~keep].sum() == 0          # never a token outside the target's top-6
    expected = p[keep] * len(seconds)
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
    assert p_value > 1e-3, (p_value, counts[keep].tolist(), expected.tolist())
    if method != "ngram":
        return
    # the same test rejects a verifier that keeps every proposal (the output would be the proposal)
    biased = torch.zeros_like(p)
    biased[proposal] = len(seconds)
    wrong = ((biased[keep] - expected) ** 2 / expected).sum()
    assert float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), wrong / 2)) < 1e-6


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(speculative="bogus"), ValueError, r"speculative='bogus' is not one of"),
    (dict(speculative="ngram", num_speculative_tokens=0), ValueError, r"num_speculative_tokens=0 must be an integer in \[1, 16\]"),
    (dict(speculative="ngram", num_speculative_tokens=17), ValueError, r"num_speculative_tokens=17"),
    (dict(speculative="ngram", kv_cache=False), ValueError, "needs kv_cache=True"),
    (dict(speculative="self", draft_num_layers=0), ValueError, r"draft_num_layers=0 must be None or an integer >= 1"),
])
def test_bad_speculative_options_are_refused(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        EngineConfig(**kwargs)


def test_self_draft_must_be_shallower_than_the_model():
    with pytest.raises(ValueError, match=r"draft_num_layers=2 must be in \[1, 1\]"):
        LLM("random:tiny-llama", speculative="self", draft_num_layers=2)


@pytest.mark.slow
def test_default_model_repeating_its_prompt(default_llm):
    text = "The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote the time in the log."
    ids = default_llm.chat_token_ids([{"role": "user", "content": "Repeat exactly:\n" + text}])
    params = SamplingParams(max_tokens=32)
    plain = default_llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = default_llm.with_levers(speculative="ngram", num_speculative_tokens=4)
    got = spec.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == plain
    assert spec.stats.spec.acceptance_rate > 0.3 and spec.stats.spec.mean_accepted_length > 1.5
    assert_engine_idle(spec)


def test_repeat_benchmark_reports_identical_outputs_and_acceptance(default_llm):
    from minillm.bench.speculative import compare_speculative, format_speculative, repeat_workload

    requests = repeat_workload(default_llm, num_requests=1, max_tokens=24)
    # the default model as its own draft: the real tokenizers are compared, every proposal is kept
    draft = {"draft k=3": dict(speculative="draft", draft_model=default_llm.engine.model_path,
                               num_speculative_tokens=3)}
    result = compare_speculative(default_llm, requests, ks=(3,), others=draft)
    off, on, drafted = result["rows"]
    assert off["label"] == "off" and on["label"] == "ngram k=3" and drafted["label"] == "draft k=3"
    assert on["identical"] == drafted["identical"] == 1 and len(on["run"].outputs[0]) == 24
    assert on["acceptance_rate"] > 0.3 and on["tokens_per_pass"] > 1.5
    assert drafted["acceptance_rate"] == 1.0 and drafted["tokens_per_pass"] > 3.5   # 24 tokens in 6-7 passes
    text = format_speculative(result)
    assert "ngram k=3" in text and "draft k=3" in text and "acceptance >= 1.5x" in text


@pytest.mark.slow
@pytest.mark.parametrize("text", [
    "The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote the time in the log.",
    "Copper conducts heat well, so the pan warms evenly and the sauce does not burn.",
])
def test_sampled_speculation_keeps_the_real_models_distribution(default_llm, text):
    """On the default model, with its own n-gram proposals (the answer repeats the prompt): the
    token after the most frequent first token, sampled through speculative steps, against the
    model's next-token distribution there (temperature 1, top-k 6); bins expected below 5 merged."""
    ids = default_llm.chat_token_ids([{"role": "user", "content": "Repeat exactly:\n" + text}])
    spec = default_llm.with_levers(speculative="ngram", num_speculative_tokens=2, max_num_seqs=64)
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(400)]
    outs = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": ids}] * len(params), params,
                                                          use_tqdm=False)]
    st = spec.stats.spec
    # proposals are made and kept (a confident model may keep all of them: the rejection path
    # is covered on the tiny model above)
    assert st.num_proposed > 0 and st.num_accepted > 0, st
    first = max(set(o[0] for o in outs), key=lambda t: sum(o[0] == t for o in outs))
    seconds = [o[1] for o in outs if o[0] == first]
    assert len(seconds) >= 100
    ref = default_llm.with_levers(kv_cache=False)
    p = _target_probs(ref, ids + [first])
    counts = torch.bincount(torch.tensor(seconds), minlength=p.numel()).double()
    p_value = chi_square_p_value(counts, p, min_df=1)
    assert p_value > 1e-3, (p_value, counts[p > 0].tolist(), (p * len(seconds))[p > 0].tolist())
    assert_engine_idle(spec)



# ----------------------------------------------------------------------------- speculative="draft"
def perturb_draft(llm, scale: float, seed: int = 1) -> None:
    """Make the draft a near copy of the target: noise on its head, so it agrees often, not always."""
    head = llm.engine.draft.model.lm_head.weight
    gen = torch.Generator().manual_seed(seed)
    head.add_(torch.randn(head.shape, generator=gen) * head.std() * scale)


def assert_draft_idle(llm) -> None:
    draft = llm.engine.draft
    assert not draft.states, f"draft states left: {list(draft.states)}"
    bm = draft.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} draft KV blocks leaked"
    bm.check()


def test_a_draft_identical_to_the_target_is_always_accepted(target_tokens):
    """The draft model's own cache is kept in step with the sequence: a draft that is the target
    itself must propose exactly the target's tokens, every time (a stale or shifted draft cache
    would break this), so every proposal is accepted."""
    llm, tokens = _run(dict(speculative="draft", draft_model="random:tiny-llama"))
    assert tokens == target_tokens
    spec = llm.stats.spec
    assert spec.num_proposed > 0 and spec.num_accepted == spec.num_proposed, spec
    assert_engine_idle(llm)
    assert_draft_idle(llm)


@pytest.mark.parametrize("levers", [
    dict(max_num_seqs=1),
    dict(),
    dict(chunked_prefill=True, max_num_batched_tokens=32, num_speculative_tokens=3),
    dict(prefix_caching=True),
    dict(kv_cache_bytes=12 * 16 * 2 * 2 * 2 * 16 * 4, block_size=16),  # 12 blocks: preemption
    dict(batching="static", num_speculative_tokens=6),
    pytest.param(dict(attention_backend="triton", num_speculative_tokens=3), marks=pytest.mark.slow),
])
def test_greedy_draft_model_speculation_equals_the_target_alone(target_tokens, levers):
    llm = LLM("random:tiny-llama", max_model_len=256, speculative="draft", draft_model="random:tiny-llama", **levers)
    perturb_draft(llm, 1.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == target_tokens
    spec = llm.stats.spec
    assert spec.num_proposed > 0 and 0 < spec.num_accepted < spec.num_proposed, spec
    assert spec.num_draft_passes > 0
    if "kv_cache_bytes" in levers:
        assert llm.stats.num_preemptions > 0
    assert_engine_idle(llm)
    assert_draft_idle(llm)


def test_a_smaller_draft_of_another_shape_keeps_the_output():
    """A draft with its own shapes (1 layer, MQA, tied head) and so its own KV pool layout."""
    plain = LLM("random:tiny-llama", max_model_len=256)
    llm = LLM("random:tiny-llama", max_model_len=256, speculative="draft", draft_model="random:tiny-llama-draft")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:8]]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS[:8], use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS[:8], use_tqdm=False)]
    assert got == want
    draft = llm.engine.draft
    assert draft.kv_cache.k[0].shape[0] == 1 != llm.engine.kv_cache.k[0].shape[0]   # its own KV heads (MQA)
    assert len(draft.kv_cache.k) == 1 and llm.stats.spec.num_proposed > 0
    assert_engine_idle(llm)
    assert_draft_idle(llm)


def test_aborting_a_request_frees_its_draft_blocks():
    llm = LLM("random:tiny-llama", max_model_len=256, speculative="draft", draft_model="random:tiny-llama")
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS[:4]]
    for _ in range(4):   # prefill, then speculative steps: the draft holds blocks for each sequence
        engine.step()
    assert engine.draft.states and engine.draft.block_manager.num_free_blocks < engine.draft.block_manager.num_blocks
    for seq in seqs:
        engine.abort(seq)
    assert_engine_idle(llm)
    assert_draft_idle(llm)


def test_a_draft_with_another_vocabulary_is_refused():
    from minillm.models.presets import PRESETS, register_preset, with_layers
    import dataclasses

    register_preset("tiny-llama-other-vocab", dataclasses.replace(with_layers(PRESETS["tiny-llama"], 1), vocab_size=300))
    with pytest.raises(ValueError, match=r"draft_model='random:tiny-llama-other-vocab' has a vocabulary of 300 "
                                         r"tokens, the target 512: the draft must share the target's tokenizer"):
        LLM("random:tiny-llama", speculative="draft", draft_model="random:tiny-llama-other-vocab")
    with pytest.raises(ValueError, match=r"has a context of 1024 tokens, shorter than max_model_len=2048"):
        register_preset("tiny-llama-long", dataclasses.replace(PRESETS["tiny-llama"], max_position_embeddings=4096))
        LLM("random:tiny-llama-long", max_model_len=2048, speculative="draft", draft_model="random:tiny-llama")
