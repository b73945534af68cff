"""The engine against transformers on the default model: greedy tokens and fp32 logits.

The engine runs every prompt in one generate() call (so batching, queueing, mixed prompt lengths and the
default chunked prefill are exercised too); transformers runs them one at a time.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from conftest import assert_engine_idle
from prompts import LONG_PROMPT, SHORT_PROMPTS

from minillm import LLM, SamplingParams

MAX_NEW = 16         # new tokens per prompt with kv_cache=True
KV_OFF_NEW = 4       # kv_cache=False recomputes every prefix: fewer tokens
LOGIT_RTOL = 1e-4    # max |diff| / max |logit|


def build_cases(llm) -> dict[str, object]:
    tok = llm.tokenizer
    cases: dict[str, object] = dict(SHORT_PROMPTS)
    cases["chat"] = llm.apply_chat_template([
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ])
    cases["one_token"] = {"prompt_token_ids": [tok.encode("Hello", add_special_tokens=False)[0]]}
    cases["long"] = LONG_PROMPT
    return cases


def run_engine(llm, prompts: list, params: SamplingParams):
    """generate() while recording every logits row the engine sampled from, per request."""
    captured: dict[str, list[torch.Tensor]] = defaultdict(list)
    runner = llm.engine.runner
    original = runner.logits

    def spy(seqs, rows=None, prompt_logprobs=False):
        out = original(seqs, rows, prompt_logprobs)
        sampled = seqs if rows is None else [seqs[i] for i in rows]   # chunked prefill: a chunk samples no row
        assert len(out) == len(sampled), f"{len(out)} logits rows for {len(sampled)} sampled sequences"
        for seq, row in zip(sampled, out):
            captured[seq.request_id].append(row.detach().clone())
        return out

    runner.logits = spy
    try:
        outs = llm.generate(prompts, params)
    finally:
        del runner.logits
    return outs, captured, llm.stats


def hf_greedy(hf, ids: list[int], max_new: int):
    """transformers' greedy continuation (stops at EOS like the engine) and its raw logits."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [row[0].float() for row in out.logits]


def divergence_report(name, mine, ref, ref_logits) -> str:
    i = next(k for k in range(min(len(mine), len(ref)) + 1)
             if k == min(len(mine), len(ref)) or mine[k] != ref[k])
    msg = f"{name}: engine {mine} vs transformers {ref}, first difference at new token {i}"
    if i < len(ref_logits):
        top = torch.topk(ref_logits[i], 2)
        msg += (f"; transformers' top-2 there: ids {top.indices.tolist()} logits {top.values.tolist()} "
                f"(gap {float(top.values[0] - top.values[1]):.3g})")
    return msg


@pytest.fixture(scope="module")
def cases(default_llm):
    return build_cases(default_llm)


@pytest.fixture(scope="module")
def kv_on_run(default_llm, cases):
    outs, captured, stats = run_engine(default_llm, list(cases.values()), SamplingParams(max_tokens=MAX_NEW))
    return dict(zip(cases, outs)), captured, stats


@pytest.fixture(scope="module")
def reference(hf_default, kv_on_run):
    """name -> (tokens, logits per step) from transformers, one prompt at a time."""
    outs, _, _ = kv_on_run
    return {name: hf_greedy(hf_default, o.prompt_token_ids, MAX_NEW) for name, o in outs.items()}


def test_cases_cover_the_required_range(cases, kv_on_run):
    outs, _, _ = kv_on_run
    lengths = {name: len(o.prompt_token_ids) for name, o in outs.items()}
    assert len(cases) >= 20
    assert lengths["one_token"] == 1
    assert 950 <= lengths["long"] <= 1000 + 100, lengths["long"]
    assert any(ord(c) > 127 for name in ("japanese", "french", "russian_emoji") for c in cases[name])
    assert "<|im_start|>" in cases["chat"]


def test_prompt_tokens_match_the_hf_tokenizer(default_llm, cases, kv_on_run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_llm.engine.model_path)
    outs, _, _ = kv_on_run
    for name, prompt in cases.items():
        expected = prompt["prompt_token_ids"] if isinstance(prompt, dict) else tok.encode(prompt)
        assert outs[name].prompt_token_ids == expected, name
        assert outs[name].prompt == (None if isinstance(prompt, dict) else prompt)


def test_greedy_matches_transformers_kv_cache_on(kv_on_run, reference, default_llm):
    outs, _, _ = kv_on_run
    failures = []
    for name, o in outs.items():
        mine = o.outputs[0].token_ids
        ref, ref_logits = reference[name]
        if mine != ref:
            failures.append(divergence_report(name, mine, ref, ref_logits))
        # stopped for the same reason transformers did
        expect_reason = "stop" if len(ref) < MAX_NEW or ref[-1] in default_llm.engine.eos_token_ids else "length"
        assert o.outputs[0].finish_reason == expect_reason, name
    assert not failures, "\n".join(failures)
    assert_engine_idle(default_llm)


def test_logits_match_transformers_fp32(kv_on_run, reference):
    """Every step's logits (prefill of each prompt, the ~1,000-token one included, and every decode)."""
    outs, captured, _ = kv_on_run
    worst = {}
    for name, o in outs.items():
        mine_rows = captured[o.request_id]
        ref_tokens, ref_rows = reference[name]
        mine_tokens = o.outputs[0].token_ids
        assert len(mine_rows) == len(mine_tokens)
        for step, (mine, ref) in enumerate(zip(mine_rows, ref_rows)):
            if mine_tokens[:step] != ref_tokens[:step]:
                break  # the inputs differ from here on (reported by the greedy test)
            assert mine.shape == ref.shape
            err = float((mine - ref).abs().max() / ref.abs().max())
            worst[name] = max(worst.get(name, 0.0), err)
    assert set(worst) == set(outs)
    bad = {k: v for k, v in worst.items() if v > LOGIT_RTOL}
    assert not bad, f"relative logit error above {LOGIT_RTOL}: {bad}"
    print(f"\nmax relative logit error: {max(worst.values()):.2e} ({max(worst, key=worst.get)})")


def test_batch_was_queued_and_outputs_keep_prompt_order(kv_on_run, cases, default_llm):
    outs, _, stats = kv_on_run
    assert len(cases) > default_llm.config.max_num_seqs  # some requests had to wait for a slot
    prefills = [s for s in stats.steps if s.kind in ("prefill", "mixed")]   # mixed: prompt chunks beside decodes
    assert len(prefills) >= 2
    assert max(s.num_seqs for s in stats.steps) == default_llm.config.max_num_seqs
    # the first step feeds the prompts in order, the last one admitted cut at the step's budget (chunked prefill)
    lengths = [len(o.prompt_token_ids) for o in list(outs.values())[: prefills[0].num_seqs]]
    assert default_llm.config.chunked_prefill
    assert sum(lengths[:-1]) < prefills[0].num_tokens == min(sum(lengths), default_llm.config.max_num_batched_tokens)
    for (name, prompt), o in zip(cases.items(), outs.values()):
        if isinstance(prompt, str):
            assert o.prompt == prompt, name
    assert stats.num_output_tokens == sum(len(o.outputs[0].token_ids) for o in outs.values())


# ---------------------------------------------------------------------------- kv_cache=False

@pytest.fixture(scope="module")
def kv_off_llm(default_model_dir):
    llm = LLM(kv_cache=False)
    assert llm.engine.block_manager is None and llm.engine.kv_cache is None
    return llm


def _check_kv_off(kv_off_llm, cases, reference, names):
    outs, captured, stats = run_engine(kv_off_llm, [cases[n] for n in names], SamplingParams(max_tokens=KV_OFF_NEW))
    failures = []
    worst = 0.0
    for name, o in zip(names, outs):
        ref, ref_logits = reference[name]
        ref = ref[:KV_OFF_NEW]
        if o.outputs[0].token_ids != ref:
            failures.append(divergence_report(name, o.outputs[0].token_ids, ref, ref_logits))
            continue
        for mine_row, ref_row in zip(captured[o.request_id], ref_logits):
            worst = max(worst, float((mine_row - ref_row).abs().max() / ref_row.abs().max()))
    assert not failures, "\n".join(failures)
    assert worst < LOGIT_RTOL, worst
    # no cache: every decode step feeds every token of every running sequence again
    assert stats.peak_kv_bytes == 0
    decode = [s for s in stats.steps if s.kind == "decode"]
    assert decode and all(s.num_tokens > s.num_seqs for s in decode)
    assert not kv_off_llm.engine.has_unfinished()


def test_greedy_matches_transformers_kv_cache_off(kv_off_llm, cases, reference):
    names = [n for n in cases if n not in ("long", "medium")]
    assert len(names) >= 18
    _check_kv_off(kv_off_llm, cases, reference, names)


@pytest.mark.slow
def test_greedy_matches_transformers_kv_cache_off_long(kv_off_llm, cases, reference):
    _check_kv_off(kv_off_llm, cases, reference, ["long", "medium", "chat", "one_token"])


# ---------------------------------------------------------------------------- batching modes

BATCH_PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "Water boils at"]
BATCH_MAX = [2, 8, 2, 8]


def _batch_params():
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in BATCH_MAX]


def test_static_and_continuous_batching_agree(default_llm, default_model_dir, monkeypatch):
    static = LLM(batching="static", max_num_seqs=2)
    s_outs = static.generate(BATCH_PROMPTS, _batch_params())
    s_steps = [(s.kind, s.num_seqs) for s in static.stats.steps]
    assert_engine_idle(static)
    del static

    monkeypatch.setattr(default_llm.config, "max_num_seqs", 2)
    c_outs = default_llm.generate(BATCH_PROMPTS, _batch_params())
    c_steps = [(s.kind, s.num_seqs) for s in default_llm.stats.steps]
    assert_engine_idle(default_llm)

    for s, c, m in zip(s_outs, c_outs, BATCH_MAX):
        assert s.outputs[0].token_ids == c.outputs[0].token_ids
        assert len(c.outputs[0].token_ids) == m and c.outputs[0].finish_reason == "length"
    # static: the second pair waits until the whole first pair is done (1 prefill + 7 decodes each)
    assert s_steps == ([("prefill", 2), ("decode", 2)] + [("decode", 1)] * 6) * 2
    # continuous: a freed slot is refilled at once, so the same work takes fewer steps; with chunked prefill (the
    # default) the new prompt shares its step with the running request's decode ("mixed")
    assert c_steps == [("prefill", 2), ("decode", 2), ("mixed", 2), ("decode", 2), ("mixed", 2)] \
        + [("decode", 2)] * 3 + [("decode", 1)] * 4
    assert len(c_steps) < len(s_steps)


@pytest.mark.slow
def test_long_generations_match_transformers(default_llm, hf_default):
    """64 new tokens: small numeric drift in a long decode would show up here."""
    prompts = ["Write a short story about a robot who learns to paint.", "def quicksort(xs):",
               "Explain how a refrigerator works.", LONG_PROMPT]
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=64))
    failures = []
    for o in outs:
        ref, ref_logits = hf_greedy(hf_default, o.prompt_token_ids, 64)
        if o.outputs[0].token_ids != ref:
            failures.append(divergence_report(o.prompt[:30], o.outputs[0].token_ids, ref, ref_logits))
    assert not failures, "\n".join(failures)
    assert_engine_idle(default_llm)
