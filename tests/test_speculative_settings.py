"""Speculative decoding with every sampling setting: logit_bias, min_tokens, the repetition / frequency / presence
penalties and structured outputs (JSON schema, regex, choice) give the plain engine's greedy output token for token
with each proposer; sampled output keeps the *processed* distribution (chi-square); a proposer that proposes
grammar-breaking tokens never gets one kept; prompt_logprobs are the plain engine's."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import assert_engine_idle, chi_square_p_value
from minillm import LLM, SamplingParams, StructuredOutputs
from minillm.engine.sequence import Sequence
from minillm.speculative.proposer import StatelessProposer
from minillm.layers.sampler import SamplingBatch, processed_probs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
AGE = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"], "additionalProperties": False}
PHONE = r"[0-9]{3}-[0-9]{4}"
TEXT = "The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote the time in the log."


@pytest.fixture(scope="module")
def prompts(default_llm):
    """"repeat": an answer that repeats the prompt (n-gram proposals are often right, so both verdicts happen);
    "short": an answer of 8 tokens, EOS included ("2 + 2 = 4")."""
    return {"repeat": default_llm.chat_token_ids([{"role": "user", "content": "Repeat exactly:\n" + TEXT}]),
            "short": default_llm.chat_token_ids([{"role": "user",
                                                  "content": "What is 2+2? Reply with the number only."}])}


def cases(tokenizer) -> list[tuple[str, SamplingParams]]:
    lit, the = tokenizer.encode(" lit")[0], tokenizer.encode(" the")[0]
    return [
        ("repeat", SamplingParams(max_tokens=12, logit_bias={lit: -6.0, the: 3.0})),
        ("short", SamplingParams(max_tokens=12, min_tokens=10)),   # its EOS (8th token) is banned
        ("repeat", SamplingParams(max_tokens=12, repetition_penalty=1.4)),
        ("repeat", SamplingParams(max_tokens=12, frequency_penalty=0.9)),
        ("repeat", SamplingParams(max_tokens=12, presence_penalty=1.2, logit_bias={the: 2.0})),
        ("short", SamplingParams(max_tokens=24, structured_outputs=StructuredOutputs(json=AGE))),
        ("short", SamplingParams(max_tokens=12, structured_outputs=StructuredOutputs(regex=PHONE))),
        ("repeat", SamplingParams(max_tokens=12, structured_outputs=StructuredOutputs(choice=["lighthouse keeper",
                                                                                              "lamp"]))),
        # ignore_eos with a grammar: only the grammar's own end (EOS, accepted by the matcher) stops it
        ("short", SamplingParams(max_tokens=12, ignore_eos=True,
                                 structured_outputs=StructuredOutputs(choice=["four", "4 exactly"]))),
    ]


@pytest.fixture(scope="module")
def plain_outputs(default_llm, prompts):
    batch = cases(default_llm.engine.tokenizer)
    requests = [{"prompt_token_ids": prompts[kind]} for kind, _ in batch]
    params = [p for _, p in batch]
    return requests, params, [o.outputs[0] for o in default_llm.generate(requests, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_greedy_speculation_with_every_setting_equals_the_plain_engine(default_llm, prompts, plain_outputs, method):
    """All settings side by side in one batch: the same tokens and finish reasons as one token per step. The
    settings change the output (the logit_bias row drops the prompt's " lit", min_tokens runs past the answer's
    EOS), so a verifier that compared proposals with the raw model's argmax would keep other tokens."""
    requests, params, want = plain_outputs
    extra = {"ngram": {}, "self": dict(draft_num_layers=10),
             "draft": dict(draft_model=default_llm.engine.model_path)}[method]
    spec = default_llm.with_levers(speculative=method, num_speculative_tokens=3, **extra)
    outs = spec.generate(requests, params, use_tqdm=False)
    for p, a, b in zip(params, want, (o.outputs[0] for o in outs)):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), (p, a.text, b.text)
    st = spec.stats.spec
    assert st.num_proposed > 0 and st.num_accepted > 0, st
    # the settings did something
    assert " lit" not in want[0].text and " lit" in default_llm.engine.tokenizer.decode(prompts["repeat"])
    assert len(want[1].token_ids) >= 10 and not set(want[1].token_ids[:10]) & default_llm.engine.eos_token_ids
    assert isinstance(json.loads(want[5].text)["age"], int) and want[5].finish_reason == "stop"
    assert re.fullmatch(PHONE, want[6].text) and want[7].text in ("lighthouse keeper", "lamp")
    assert want[8].text in ("four", "4 exactly") and want[8].finish_reason == "stop"
    assert_engine_idle(spec)


# ----------------------------------------------------------------------------- a proposer that breaks the grammar
class RawModelProposer(StatelessProposer):
    """Proposes the model's own unconstrained greedy continuation (a twin without a KV cache runs it): where the
    grammar forbids the model's favourite token, that is exactly the token a verifier that skipped the grammar's
    mask would keep. Counts the proposals the grammar refuses (on a fork of each request's matcher). The twin
    shares the engine's weights: the engine's runner is bound back afterwards (its KV pool)."""

    def __init__(self, twin):
        self.twin, self.refused, self.proposed = twin, 0, 0

    def propose(self, seqs, budgets):
        proposals = []
        for seq, budget in zip(seqs, budgets):
            tokens = list(seq.token_ids)
            for _ in range(budget):
                logits = self.twin.engine.runner.logits([Sequence(list(tokens), SamplingParams())])[0]
                tokens.append(int(logits.argmax()))
            proposal = tokens[len(seq):]
            if seq.grammar is not None and proposal:
                fork = seq.grammar.fork()
                ok = [fork.accept_token(t) for t in proposal]
                self.refused += ok.count(False) > 0
            self.proposed += len(proposal)
            proposals.append(proposal)
        return proposals, [None] * len(seqs)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grammar_breaking_proposals_are_never_kept(default_llm, temperature):
    twin = default_llm.with_levers(kv_cache=False)
    proposer = RawModelProposer(twin)
    spec = default_llm.with_levers(speculative="ngram", num_speculative_tokens=2, proposer=proposer)
    # the model wants to answer in words; the grammar wants a phone number and a small JSON object
    prompts = ["Tell me about the sea.", "Who are you?"]
    sos = [StructuredOutputs(regex=PHONE), StructuredOutputs(json=SCHEMA)]
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=3, structured_outputs=so) for so in sos]
    outs = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert proposer.refused > 0 and proposer.proposed > 0, "the proposer never broke the grammar: the test is void"
    assert re.fullmatch(PHONE, outs[0].text), outs[0].text
    answer = json.loads(outs[1].text)
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int) and len(answer["name"]) <= 10
    assert all(o.finish_reason == "stop" for o in outs)
    if temperature == 0.0:   # greedy: the plain engine's tokens exactly
        plain = [o.outputs[0] for o in default_llm.generate(prompts, params, use_tqdm=False)]
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert_engine_idle(spec)


def test_apply_proposals_masks_each_row_at_its_position_and_rolls_back(default_llm):
    """Row j of a sequence is masked at the matcher's state after proposal[:j]; from a refused proposal on, the
    rows repeat the last mask; the matcher ends where it started."""
    engine = default_llm.engine
    tok = engine.tokenizer
    matcher = engine.grammar_matcher(StructuredOutputs(regex=PHONE))
    assert matcher.accept_token(tok.encode("1")[0])
    grammars = engine.runner.grammars
    digits = [tok.encode(d)[0] for d in "2345"]
    dash, letter = tok.encode("-")[0], tok.encode("x")[0]
    proposal = [digits[0], digits[1], dash, letter, digits[2]]   # "1" + "23-" fits; "x" is refused
    vocab = engine.model_config.vocab_size
    logits = torch.zeros(2 + len(proposal) + 1, vocab)
    grammars.apply_proposals(logits, [None, matcher], [[7], proposal])
    allowed = [set((row > float("-inf")).nonzero().flatten().tolist()) for row in logits]
    assert len(allowed[0]) == len(allowed[1]) == vocab               # no matcher: untouched
    assert dash not in allowed[2] and digits[0] in allowed[2]        # after "1": a digit, not the dash
    assert dash not in allowed[3] and digits[1] in allowed[3]        # after "12": a digit
    assert dash in allowed[4] and digits[0] not in allowed[4]        # after "123": the dash only
    assert letter not in allowed[5] and digits[2] in allowed[5]      # after "123-": a digit
    assert allowed[6] == allowed[5] and allowed[7] == allowed[5]     # after the refused "x": the last mask
    assert not matcher.is_completed() and matcher.accept_token(digits[1]) and not matcher.accept_token(dash)


# ----------------------------------------------------------------------------- sampling: the processed distribution
def _processed(ref, prompt, output, params):
    logits = ref.engine.runner.logits([Sequence(list(prompt) + list(output), SamplingParams())])
    batch = SamplingBatch([params], [None], [list(prompt)], [list(output)], [[]])
    return processed_probs(logits, batch)[0].double()


class PinnedProposer(StatelessProposer):
    """Proposes the same token k times (deterministic: q is a point mass)."""

    def __init__(self, token):
        self.token = token

    def propose(self, seqs, budgets):
        return [[self.token] * b for b in budgets], [None] * len(seqs)


@pytest.mark.parametrize("method", ["pinned", "self", "draft"])
def test_sampled_speculation_with_penalties_and_bias_keeps_the_processed_distribution(method):
    """The second output token given the first, and the third given the first two when the second is the pinned
    proposal (the bonus row, whose history holds that proposal): chi-square against the plain engine's processed
    distribution there. logit_bias lifts two tokens the raw model ranks 12th and 20th (a and b) to the top; the
    repetition, frequency and presence penalties then push each down once it is in the history: a is the likely
    first token, b the likely second (the pinned proposal), and b is penalised in the third token's row only if
    that row's history holds the proposal. A verifier on the raw distribution fails it (checked below)."""
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    ref = LLM("random:tiny-llama", max_model_len=64, kv_cache=False)
    raw = ref.engine.runner.logits([Sequence(list(prompt), SamplingParams())])[0]
    a, b = int(raw.topk(12).indices[-1]), int(raw.topk(20).indices[-1])
    base = dict(temperature=1.0, top_k=8, repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4,
                logit_bias={a: 2.5, b: 1.5}, max_tokens=3, ignore_eos=True)
    p0 = _processed(ref, prompt, [], SamplingParams(**base))
    first = int(p0.argmax())
    p1 = _processed(ref, prompt, [first], SamplingParams(**base))
    proposal = b   # plausible after a (a third of p1's mass): accepted and rejected both
    p2 = _processed(ref, prompt, [first, proposal], SamplingParams(**base))
    assert first == a and 0.1 < p1[b] < 0.6 and p2[b] < 0.01 < p1[b], (first, a, p1[b], p2[b])

    levers = dict(proposer=PinnedProposer(proposal), speculative="ngram") if method == "pinned" else dict(
        speculative=method, **(dict(draft_model="random:tiny-llama") if method == "draft" else {}))
    llm = LLM("random:tiny-llama", max_model_len=64, max_num_seqs=256, num_speculative_tokens=1, **levers)
    if method == "draft":   # a near copy of the target: q close to p, not equal
        head = llm.engine.draft.model.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(1)) * head.std() * 0.5)
    params = [SamplingParams(**base, seed=s) for s in range(2000)]
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * len(params), params,
                                                         use_tqdm=False)]
    spec = llm.stats.spec
    assert 0 < spec.num_accepted < spec.num_proposed, spec
    seconds = torch.tensor([o[1] for o in outs if o[0] == first])
    thirds = torch.tensor([o[2] for o in outs if o[0] == first and o[1] == proposal])
    assert len(seconds) > 600 and len(thirds) > 100, (len(seconds), len(thirds))
    vocab = p1.numel()
    assert chi_square_p_value(torch.bincount(seconds, minlength=vocab).double(), p1, min_df=2) > 1e-3
    assert chi_square_p_value(torch.bincount(thirds, minlength=vocab).double(), p2, min_df=2) > 1e-3
    if method == "pinned":   # the test has teeth: the raw distribution there is rejected
        from minillm.layers.sampler import filter_logits

        raw1 = ref.engine.runner.logits([Sequence(prompt + [first], SamplingParams())])[0]
        q = filter_logits(raw1, 1.0, 8, 1.0).softmax(-1).double()
        counts = torch.bincount(seconds, minlength=vocab).double()
        assert counts[q == 0].sum() > 0 or chi_square_p_value(counts, q, min_df=2) < 1e-6
    assert_engine_idle(llm)


# ----------------------------------------------------------------------------- prompt logprobs
def test_prompt_logprobs_with_speculation_equal_the_plain_engines(default_llm, prompts):
    prompt_ids = prompts["repeat"]
    params = SamplingParams(max_tokens=8, prompt_logprobs=2, logprobs=1)
    plain = default_llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    spec = default_llm.with_levers(speculative="ngram", num_speculative_tokens=3)
    fast = spec.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    assert spec.stats.spec.num_accepted > 0
    assert fast.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(fast.prompt_logprobs) == len(plain.prompt_logprobs) == len(prompt_ids)
    assert fast.prompt_logprobs[0] is None and plain.prompt_logprobs[0] is None
    for a, b in zip(fast.prompt_logprobs[1:], plain.prompt_logprobs[1:]):
        assert list(a) == list(b)
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank for t in a)
    assert_engine_idle(spec)
