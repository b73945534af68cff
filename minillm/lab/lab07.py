"""Lab 07 helpers — speculative decoding: checks of the learner's greedy verifier, n-gram proposer and
rejection sampler (against minillm.speculative), `plugged` (the learner's functions as the engine's parts),
the printouts of the notebook's experiments (the toy, the engine on your functions: their code is in
the notebook), the chi-square test, and the k sweep on the repeat workload.

The learner writes, with fixed signatures:

    greedy_verify(proposal, target_argmax) -> kept tokens            # target_argmax has k + 1 entries
    ngram_propose(token_ids, k, max_n=3, min_n=1) -> up to k tokens   # [] when nothing matches
    rejection_sample(proposal, draft_probs, target_probs, generator) -> kept tokens
    chi_square_test(counts, probs) -> (statistic, p_value)             # a measurement: Pearson's test
    expected_tokens_per_pass(alpha, k) -> float
    answer_tokens_limit: float                                         # a short answer: the k -> inf limit
    spec_rates(run, base) -> {acceptance_rate, tokens_per_pass, pass_cost, speedup}   # from a sweep's raw counters

Every check calls the learner's code through `call_learner`, so a crash is a CheckFailed that names the call.

The engine takes a Proposer and a Verifier as parts (`llm.with_levers(proposer=, verifier=)`,
protocols in minillm/seams.py); `plugged` wraps the learner's functions into them and records each call.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable

import torch

from ..sampling import SamplingParams
from ..speculative.ngram import ngram_propose as ref_ngram_propose
from ..speculative.verify import greedy_verify as ref_greedy_verify
from ..speculative.verify import rejection_sample as ref_rejection_sample
from ..speculative.verify import residual_distribution
from .common import (CheckFailed, call_learner, chi_square_p_value, echo_prediction, is_close, new_figure, passed,
                     print_beside_reference, require_kernel)

_call = call_learner   # lab/common.py

TOY_SENTENCE = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
                "father had taught him.")
TIMING_SENTENCE = ("Every morning the baker opened the shutters, swept the step, and set the first loaves on the "
                   "cooling rack by the window.")
OPEN_QUESTIONS = ("Why is the sky blue? Explain it to a child.",
                  "Write a short poem about a cat who wants to fly.",
                  "What should I cook for dinner tonight? Give me three ideas.",
                  "Describe the taste of coffee to someone who has never had it.")


# =================================================================== engine plumbing
@contextlib.contextmanager
def plugged(propose: Callable | None = None, verify: Callable | None = None, sample: Callable | None = None):
    """The learner's proposer / greedy verifier / rejection sampler as engine parts, for the `with`
    block. Yields a record: 'parts' (pass them on: `llm.with_levers(speculative="ngram", **record["parts"])`
    — a Proposer and a Verifier, minillm/seams.py), 'rounds' (one dict per greedy verification:
    proposal, target_argmax, kept) and call counts. None takes minillm.speculative's own function."""
    from ..speculative.ngram import NgramProposer
    from ..speculative.verify import SpecVerifier

    record = {"rounds": [], "propose_calls": 0, "verify_calls": 0, "sample_calls": 0}
    proposer = propose or ref_ngram_propose
    verifier = verify or ref_greedy_verify
    sampler = sample or ref_rejection_sample

    def propose_wrapper(token_ids, k):
        record["propose_calls"] += 1
        return [int(t) for t in proposer(list(token_ids), k)][:k]

    def verify_wrapper(proposal, target_argmax):
        record["verify_calls"] += 1
        kept = [int(t) for t in verifier(list(proposal), list(target_argmax))]
        record["rounds"].append({"proposal": list(proposal), "target_argmax": list(target_argmax), "kept": kept})
        return kept

    cpu_generators: dict = {}

    def sample_wrapper(proposal, draft_probs, target_probs, generator=None):
        record["sample_calls"] += 1
        target_probs = target_probs.detach().cpu()   # the learner works on the CPU, whatever the device
        if draft_probs is None:   # a deterministic proposer: all of q's mass on the proposed token
            draft_probs = torch.zeros(len(proposal), target_probs.shape[1], dtype=target_probs.dtype)
            if proposal:
                draft_probs[torch.arange(len(proposal)), torch.tensor(proposal)] = 1.0
        draft_probs = draft_probs.detach().cpu()
        if generator is not None and generator.device.type != "cpu":
            # one CPU generator per request, seeded from the request's own (so seeded requests repeat)
            if id(generator) not in cpu_generators:
                seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
                cpu_generators[id(generator)] = (generator, torch.Generator().manual_seed(seed))
            generator = cpu_generators[id(generator)][1]
        return [int(t) for t in sampler(list(proposal), draft_probs, target_probs, generator)]

    record["parts"] = {"proposer": NgramProposer(propose_wrapper),
                       "verifier": SpecVerifier(verify_wrapper, sample_wrapper)}
    yield record


def repeat_prompt(llm, sentence: str = TOY_SENTENCE) -> dict:
    """A chat prompt whose answer repeats the prompt."""
    ids = llm.chat_token_ids([{"role": "user", "content": f"Repeat the following sentence exactly, word for word:\n\n{sentence}"}])
    return {"prompt_token_ids": ids}


def open_prompt(llm, question: str = OPEN_QUESTIONS[0]) -> dict:
    return {"prompt_token_ids": llm.chat_token_ids([{"role": "user", "content": question}])}


# =================================================================== 1. the toy on the real model
def print_toy(toy: dict) -> None:
    tok = toy["tokenizer"]
    show = lambda ids: repr(tok.decode(ids)) if ids else "(nothing)"  # noqa: E731
    print(f"prefill (its own pass, as always): first token {show(toy['tokens'][:1])}")
    total = 0
    for i, r in enumerate(toy["rounds"], 1):
        total += len(r["kept"])
        accepted = len(r["kept"]) - 1
        print(f"round {i}: proposed {show(r['proposal'])} ({len(r['proposal'])} tokens, no model)")
        print(f"         one target pass scores {len(r['proposal']) + 1} positions -> keeps {show(r['kept'])}: "
              f"{accepted} accepted + 1 from the target; {total} tokens after {i} pass{'es' if i > 1 else ''}")
    print(f"decode: {toy['emitted']} tokens from {toy['passes']} target passes "
          f"(without speculation: {toy['emitted']} passes)")
    print(f"answer: {toy['text']!r}")


# =================================================================== 2. greedy verification
def _greedy_cases(seed: int, num: int = 200) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(num):
        k = rng.randint(0, 8)
        target = [rng.randrange(5) for _ in range(k + 1)]
        agree = rng.randint(0, k)
        proposal = target[:agree] + [(t + 1 + rng.randrange(3)) % 5 for t in target[agree:k]]
        # after the first disagreement, later proposals may agree again by chance: keep some
        if agree < k and rng.random() < 0.5:
            proposal[agree + 1:] = target[agree + 1:k]
        cases.append((proposal, target))
    return cases


def _diagnose_greedy(proposal, target, got, want) -> str:
    k = len(proposal)
    agree = len(want) - 1
    if agree == k and list(got) == want[:-1]:
        return ("every proposal was accepted, and then the target's token after the last one (the bonus, "
                "target_argmax[k]) is free: the pass already computed it")
    if agree < k and list(got) == want[:-1]:
        return (f"proposal[{agree}] = {proposal[agree]} disagrees with the target's {target[agree]}: keep the "
                "target's token there (one pass always yields at least one token)")
    if agree < k and list(got) == proposal[:agree + 1]:
        return (f"at the first disagreement (position {agree}) keep the target's token {target[agree]}, "
                f"not the proposal's {proposal[agree]}")
    if len(got) > len(want):
        return (f"stop at the first disagreement (position {agree}): the target's tokens after it were scored "
                "after a wrong token, so they are not what the target would have produced")
    return "keep the proposal's agreeing prefix, then the target's token at the first disagreement (or the bonus)"


def check_greedy_verify(greedy_verify: Callable, seed: int = 0, num_cases: int = 200) -> None:
    """Your verifier vs minillm.speculative.verify.greedy_verify on random cases."""
    for proposal, target in _greedy_cases(seed, num_cases):
        got = _call(greedy_verify, (list(proposal), list(target)), f"greedy_verify({proposal}, {target})")
        want = ref_greedy_verify(proposal, target)
        if not isinstance(got, (list, tuple)) or [int(t) for t in got] != want:
            raise CheckFailed(f"greedy_verify({proposal}, {target}) returned {got!r}, expected {want}: "
                              + _diagnose_greedy(proposal, target, got if isinstance(got, (list, tuple)) else [], want))
    passed("greedy_verify", num_cases)


def check_greedy_verify_edges(greedy_verify: Callable) -> None:
    cases = [([], [7], "an empty proposal: a plain decode step, the target's token only"),
             ([1, 2, 3], [9, 2, 3, 4], "nothing accepted: the first proposal is already wrong"),
             ([1, 2, 3], [1, 2, 3, 4], "all accepted, plus the bonus token"),
             ([5], [5, 5], "k = 1, accepted, bonus"),
             ([1, 2, 3, 4], [1, 2, 8, 4, 6], "agreement after a disagreement does not count")]
    for proposal, target, why in cases:
        got = _call(greedy_verify, (list(proposal), list(target)), f"greedy_verify({proposal}, {target})", why)
        want = ref_greedy_verify(proposal, target)
        if not isinstance(got, (list, tuple)) or [int(t) for t in got] != want:
            raise CheckFailed(f"greedy_verify({proposal}, {target}) returned {got!r}, expected {want} ({why}): "
                              + _diagnose_greedy(proposal, target, got if isinstance(got, (list, tuple)) else [], want))
    passed("greedy_verify edge cases", len(cases))


# =================================================================== 3. the n-gram proposer
def _variant_first_occurrence(token_ids, k, max_n=3, min_n=1):
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        for start in range(0, length - n):
            if token_ids[start:start + n] == tail and token_ids[start + n:start + n + k]:
                return token_ids[start + n:start + n + k]
    return []


def _variant_shortest_first(token_ids, k, max_n=3, min_n=1):
    length = len(token_ids)
    for n in range(min_n, min(max_n, length - 1) + 1):
        tail = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == tail and token_ids[start + n:start + n + k]:
                return token_ids[start + n:start + n + k]
    return []


def _variant_no_overlap(token_ids, k, max_n=3, min_n=1):
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        for start in range(length - 2 * n, -1, -1):
            if token_ids[start:start + n] == tail:
                return token_ids[start + n:start + n + k]
    return []


def _diagnose_ngram(token_ids, k, max_n, min_n, got) -> str:
    want = ref_ngram_propose(token_ids, k, max_n, min_n)
    if len(got) > k:
        return f"return at most k = {k} tokens"
    if got == _variant_no_overlap(token_ids, k, max_n, min_n):
        return ("an earlier occurrence may overlap the tail: any start before len(token_ids) - n counts, and the most "
                "recent one is the largest such start")
    if got == _variant_first_occurrence(token_ids, k, max_n, min_n):
        return "you took the earliest occurrence; take the most recent one (scan start positions from the end)"
    if got == _variant_shortest_first(token_ids, k, max_n, min_n):
        return "you tried short n-grams first; try n = max_n first (a longer match is a better predictor)"
    if not got and want:
        return ("a match exists: the last token(s) occur earlier; skip the tail's own position (it has no "
                "continuation) and look further back")
    if got and not want:
        return ("nothing should match: only n-grams with min_n <= n <= max_n count, the tail never matches "
                "itself, and a continuation must lie inside the sequence")
    if len(got) < len(want) and got == want[:len(got)]:
        return "take up to k tokens of the continuation, not fewer"
    return "longest n first (max_n down to min_n), most recent earlier match, its next k tokens (clipped at the end)"


def _ngram_cases(seed: int, num: int):
    rng = random.Random(seed)
    cases = []
    for _ in range(num):
        length = rng.randint(0, 30)
        vocab = rng.choice((2, 3, 5, 8))
        ids = [rng.randrange(vocab) for _ in range(length)]
        max_n = rng.randint(1, 4)
        min_n = rng.randint(1, max_n)
        cases.append((ids, rng.randint(1, 8), max_n, min_n))
    return cases


def check_ngram_propose(ngram_propose: Callable, seed: int = 0, num_cases: int = 300) -> None:
    """Your proposer vs minillm.speculative.ngram.ngram_propose on random short sequences."""
    for ids, k, max_n, min_n in _ngram_cases(seed, num_cases):
        got = _call(lambda *a: ngram_propose(*a[:2], max_n=a[2], min_n=a[3]), (list(ids), k, max_n, min_n),
                    f"ngram_propose({ids}, k={k}, max_n={max_n}, min_n={min_n})")
        want = ref_ngram_propose(ids, k, max_n, min_n)
        if not isinstance(got, (list, tuple)) or [int(t) for t in got] != want:
            got_list = [int(t) for t in got] if isinstance(got, (list, tuple)) else []
            raise CheckFailed(f"ngram_propose({ids}, k={k}, max_n={max_n}, min_n={min_n}) returned {got!r}, "
                              f"expected {want}: " + _diagnose_ngram(ids, k, max_n, min_n, got_list))
    passed("ngram_propose", num_cases)


def check_ngram_edges(ngram_propose: Callable) -> None:
    cases = [([1, 2, 3, 1, 2], 4, 3, 1, "continuation clipped at the end: [3, 1, 2] then nothing more"),
             ([4, 5, 6, 7], 3, 3, 1, "no earlier occurrence: []"),
             ([], 3, 3, 1, "an empty sequence"),
             ([9], 3, 3, 1, "one token: nothing before it"),
             ([1, 2, 9, 2, 8, 1, 2], 2, 3, 1, "longest match first: '1 2' -> [9, 2], not '2' -> [8, 1]"),
             ([7, 1, 7, 2, 7], 1, 3, 1, "most recent occurrence of 7: [2]"),
             ([1, 2, 3, 4, 2], 2, 3, 2, "min_n = 2: a lone '2' does not count"),
             ([5, 5, 5, 5], 3, 2, 1, "overlapping: the tail '5 5' last occurred at 1, followed by [5]")]
    for ids, k, max_n, min_n, why in cases:
        got = _call(lambda *a: ngram_propose(*a[:2], max_n=a[2], min_n=a[3]), (list(ids), k, max_n, min_n),
                    f"ngram_propose({ids}, k={k}, max_n={max_n}, min_n={min_n})", why)
        want = ref_ngram_propose(ids, k, max_n, min_n)
        if not isinstance(got, (list, tuple)) or [int(t) for t in got] != want:
            got_list = [int(t) for t in got] if isinstance(got, (list, tuple)) else []
            raise CheckFailed(f"ngram_propose({ids}, k={k}, max_n={max_n}, min_n={min_n}) returned {got!r}, "
                              f"expected {want} ({why}): " + _diagnose_ngram(ids, k, max_n, min_n, got_list))
    passed("ngram_propose edge cases", len(cases))


# =================================================================== 4. the engine on your functions
def print_plugged(result: dict) -> None:
    verdict = "✓ identical to speculation off" if result["equal"] else "✗ differs from speculation off"
    print(f"{verdict}: {sum(len(t) for t in result['tokens'])} greedy tokens over {len(result['tokens'])} prompts")
    r = result["record"]
    print(f"your ngram_propose was called {r['propose_calls']} times, your greedy_verify {r['verify_calls']} times")
    print(f"k = {result['k']}: {result['accepted']} of {result['proposed']} proposed tokens accepted "
          f"(acceptance rate {result['acceptance_rate']:.1%}); {result['emitted']} tokens from {result['passes']} "
          f"target passes = {result['tokens_per_pass']:.2f} tokens per pass")
    for text in result["text"]:
        print(f"  {text[:100]!r}")


def check_plugged(result: dict | None) -> None:
    """The engine's run on the learner's proposer and verifier (run_plugged's result): same tokens as
    speculation off, the functions were called, and some proposals were accepted."""
    if result is None:
        raise CheckFailed("plug_run is None: run the cell above (it needs greedy_verify and ngram_propose)")
    if result["record"]["verify_calls"] == 0 or result["record"]["propose_calls"] == 0:
        raise CheckFailed("the engine never called your functions: run the cell above with speculative='ngram'")
    if not result["equal"]:
        for i, (a, b) in enumerate(zip(result["tokens"], result["expected"])):
            if a != b:
                j = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise CheckFailed(f"prompt {i}: with your functions the engine produced {a[:j + 3]}..., speculation "
                                  f"off {b[:j + 3]}...; they part at output token {j}. Greedy speculation must keep "
                                  "only the target's own tokens: check greedy_verify")
    if not result["accepted"] > 0:
        raise CheckFailed("no proposed token was accepted on prompts that repeat themselves: check ngram_propose "
                          "(the proposals must continue an earlier occurrence of the sequence's last tokens)")
    passed("the engine on your proposer and verifier", len(result["tokens"]))


# =================================================================== 5. rejection sampling
def synthetic_case(vocab: int = 6, k: int = 3, seed: int = 0, far: bool = True):
    """Context-free target p_i and draft q_i per position ([k + 1, V] and [k, V]): whatever came
    before, position i's target distribution is p_i, so every emitted token at position i must
    follow p_i. `far`: q puts its mass where p does not (many rejections)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=g, dtype=torch.float64) ** 2 + 0.02
    p = p / p.sum(-1, keepdim=True)
    if far:
        q = p[:k].flip(-1) + 0.05 * torch.rand(k, vocab, generator=g, dtype=torch.float64)
    else:
        q = p[:k] + 0.3 * torch.rand(k, vocab, generator=g, dtype=torch.float64)
    q = q / q.sum(-1, keepdim=True)
    return p, q


def sample_rounds(rejection_sample: Callable, p: torch.Tensor, q: torch.Tensor, num_rounds: int, seed: int = 0):
    """Run `num_rounds` rounds: draw k proposals from q, verify with your sampler. Returns the counts of
    the token emitted at each position [k + 1, V], the rounds reaching each position, and the outputs."""
    k, vocab = q.shape
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(k + 1, vocab, dtype=torch.long)
    lengths = torch.zeros(k + 2, dtype=torch.long)
    for _ in range(num_rounds):
        proposal = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        out = _call(rejection_sample, (list(proposal), q.clone(), p.clone(), g),
                    f"rejection_sample({proposal}, draft_probs, target_probs, generator) with k = {k}")
        if not isinstance(out, (list, tuple)) or not 1 <= len(out) <= k + 1:
            raise CheckFailed(f"rejection_sample({proposal}, ...) with k = {k} returned {out!r}; expected 1 to "
                              f"k + 1 = {k + 1} tokens (the accepted prefix, then one corrected or bonus token)")
        out = [int(t) for t in out]
        if out[:-1] != proposal[:len(out) - 1]:
            raise CheckFailed(f"rejection_sample({proposal}, ...) returned {out}: every token but the last must be an "
                              "accepted proposal, in order; stop at the first rejection")
        for i, t in enumerate(out):
            counts[i, t] += 1
        lengths[len(out)] += 1
    return counts, lengths


def skip_correction_sample(proposal, draft_probs, target_probs, generator=None):
    """The usual mistake: accept with min(1, p/q), but on a rejection draw from p itself, not from
    normalize(max(p - q, 0)). Tokens q over-proposes are counted twice."""
    out = []
    for i, x in enumerate(proposal):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand(1, generator=generator).item() < min(1.0, (p[x] / q[x]).item()):
            out.append(x)
            continue
        out.append(int(torch.multinomial(p, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(proposal)], 1, generator=generator)))
    return out


def chi_square_report(rejection_sample: Callable, num_rounds: int = 3000, vocab: int = 6, k: int = 3,
                      seed: int = 0, far: bool = True, test: Callable | None = None) -> dict:
    """Per position: the emitted tokens' counts and their p-value against the target's p_i, from `test`
    (the learner's chi_square_test(counts, probs) -> (statistic, p_value)) or, for grading, from
    chi_square_p_value. Positions reached by fewer than 50 rounds get no p-value (nan)."""
    p, q = synthetic_case(vocab, k, seed, far)
    counts, lengths = sample_rounds(rejection_sample, p, q, num_rounds, seed=seed + 1)
    rows = []
    for i in range(k + 1):
        n = int(counts[i].sum())
        p_value = float("nan")
        if n >= 50 and test is None:
            p_value = chi_square_p_value(counts[i], p[i])
        elif n >= 50:
            result = _call(test, (counts[i].clone(), p[i].clone()), f"chi_square_test(counts[{i}], p[{i}])")
            p_value = float(result[1])
        rows.append({"position": i, "n": n, "p_value": p_value, "counts": counts[i].tolist(),
                     "observed": (counts[i].double() / max(n, 1)).tolist(), "target": p[i].tolist()})
    accepted = sum((len_ - 1) * int(c) for len_, c in enumerate(lengths.tolist()) if len_ > 0)
    return {"rows": rows, "num_rounds": num_rounds, "k": k, "vocab": vocab, "p": p, "q": q, "counts": counts,
            "acceptance_rate": accepted / (k * num_rounds), "tokens_per_round": float(counts.sum()) / num_rounds}


def _ref_chi_square(counts, probs) -> tuple[float, float]:
    """Pearson's statistic and its p-value; tokens with probability 0 are left out (inf and 0.0 when one
    of them was emitted)."""
    counts = torch.as_tensor(counts).double()
    expected = torch.as_tensor(probs).double() * counts.sum()
    keep = expected > 0
    if (counts[~keep] > 0).any():
        return float("inf"), 0.0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, chi_square_p_value(counts, torch.as_tensor(probs))


def _chi_square_hint(counts, probs, stat: float, p_value: float, want_stat: float, want_p: float) -> str:
    counts = torch.as_tensor(counts).double()
    probs = torch.as_tensor(probs).double()
    n = float(counts.sum())
    keep = probs > 0
    df = int(keep.sum()) - 1
    if math.isinf(want_stat):
        return ("a token the target gives probability 0 was emitted: the sampler is certainly wrong, so the "
                "statistic is inf and the p-value 0.0")
    if is_close(stat, want_stat, rel=1e-6):
        def upper(a: float, x: float) -> float:
            a_, x_ = torch.tensor(a, dtype=torch.float64), torch.tensor(x, dtype=torch.float64)
            return float(torch.special.gammaincc(a_, x_))

        for wrong_df, why in ((df + 1, "the degrees of freedom are (tokens with p > 0) - 1, not the vocabulary size"),
                              (df + 1 + int((~keep).sum()), "the degrees of freedom are (tokens with p > 0) - 1")):
            if is_close(p_value, upper(wrong_df / 2, stat / 2), rel=1e-6):
                return why
        if df > 0 and is_close(p_value, upper(df, stat), rel=1e-6):
            return "the p-value is gammaincc(df / 2, statistic / 2): both halved"
        if is_close(p_value, 1 - want_p, rel=1e-6):
            return ("the p-value is the upper tail, gammaincc (the chance of a deviation at least this large), "
                    "not gammainc")
        return "the p-value is torch.special.gammaincc(df / 2, statistic / 2) with df = (tokens with p > 0) - 1"
    e = probs * n
    if is_close(stat, float(((counts[keep] - e[keep]) ** 2 / counts[keep].clamp_min(1)).sum()), rel=1e-6):
        return "divide by the expected count n * p, not by the observed count"
    if is_close(stat, float(((counts - probs) ** 2 / probs.clamp_min(1e-300))[keep].sum()), rel=1e-6):
        return "the expected counts are n * p (n = counts.sum()), not the probabilities p"
    if is_close(stat, float((((counts[keep] - e[keep]) ** 2) / e[keep]).sum()) / n, rel=1e-6):
        return "the statistic is a sum of counts, not of frequencies: do not divide by n"
    if math.isnan(stat) or math.isinf(stat):
        return ("leave out the tokens the target gives probability 0 (their expected count is 0): they are not "
                "emitted by a right sampler")
    return "the statistic is sum((observed - expected)^2 / expected) with expected = n * p"


def check_chi_square_test(chi_square_test: Callable, report: dict | None) -> None:
    """The learner's Pearson test: recomputed on the counts of their own sampler's run (`report`, from
    chi_square_report), then on small cases with zero-probability tokens."""
    if report is None:
        raise CheckFailed("chi is None: run the cell above (it needs rejection_sample and chi_square_test)")
    p = report["p"]
    cases = [(f"chi_square_test(counts[{i}], p[{i}]) (your sampler's position {i}, {int(report['counts'][i].sum())} "
              "tokens)", report["counts"][i].clone(), p[i].clone()) for i in range(report["k"] + 1)
             if int(report["counts"][i].sum()) >= 50]
    cases += [("chi_square_test([520, 240, 240], [0.5, 0.25, 0.25])", torch.tensor([520, 240, 240]),
               torch.tensor([0.5, 0.25, 0.25])),
              ("chi_square_test([60, 40], [0.5, 0.5]) (two tokens: 1 degree of freedom)", torch.tensor([60, 40]),
               torch.tensor([0.5, 0.5], dtype=torch.float64)),
              ("chi_square_test([50, 30, 0, 20], [0.5, 0.3, 0.0, 0.2]) (a token of probability 0, never emitted)",
               torch.tensor([50, 30, 0, 20]), torch.tensor([0.5, 0.3, 0.0, 0.2], dtype=torch.float64)),
              ("chi_square_test([50, 30, 1, 19], [0.5, 0.3, 0.0, 0.2]) (a token of probability 0, emitted once)",
               torch.tensor([50, 30, 1, 19]), torch.tensor([0.5, 0.3, 0.0, 0.2], dtype=torch.float64))]
    for call, counts, probs in cases:
        got = _call(chi_square_test, (counts.clone(), probs.clone()), call)
        want_stat, want_p = _ref_chi_square(counts, probs)
        if not isinstance(got, (list, tuple)) or len(got) != 2:
            raise CheckFailed(f"{call} returned {got!r}; expected a pair (statistic, p_value) = "
                              f"({want_stat:.4g}, {want_p:.4g})")
        try:
            stat, p_value = float(got[0]), float(got[1])
        except (TypeError, ValueError):
            raise CheckFailed(f"{call} returned {got!r}; expected two numbers (statistic, p_value)") from None
        stat_ok = (math.isinf(want_stat) and math.isinf(stat) and stat > 0) or is_close(stat, want_stat, rel=1e-6)
        p_ok = is_close(p_value, want_p, rel=1e-6, abs_tol=1e-12)
        if not (stat_ok and p_ok):
            raise CheckFailed(f"{call} returned ({stat:.6g}, {p_value:.6g}), expected ({want_stat:.6g}, {want_p:.6g}): "
                              + _chi_square_hint(counts, probs, stat, p_value, want_stat, want_p))
    passed("chi_square_test", len(cases))


ALPHA = 1e-3   # reject "follows p" below this p-value (seeded runs: a correct sampler passes with margin)


def print_chi_square(report: dict, name: str = "your rejection_sample") -> None:
    print(f"{name}: {report['num_rounds']} rounds, k = {report['k']}, vocabulary {report['vocab']}; acceptance "
          f"rate {report['acceptance_rate']:.1%}, {report['tokens_per_round']:.2f} tokens per round")
    for r in report["rows"]:
        obs = " ".join(f"{v:.3f}" for v in r["observed"])
        tgt = " ".join(f"{v:.3f}" for v in r["target"])
        verdict = "n/a (too few)" if math.isnan(r["p_value"]) else (
            f"p = {r['p_value']:.3g} " + ("✓" if r["p_value"] >= ALPHA else "✗ not the target's distribution"))
        print(f"  position {r['position']} ({r['n']:>5} tokens): observed [{obs}]  target [{tgt}]  {verdict}")


def check_rejection_sample_shape(rejection_sample: Callable) -> None:
    """Deterministic corners: q == p accepts everything; p(x) = 0 always rejects x; an empty proposal
    is one draw from target_probs[0]; a residual that sums to zero falls back to p."""
    vocab, k = 5, 3
    p = torch.full((k + 1, vocab), 1 / vocab, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        proposal = [int(t) for t in torch.randint(0, vocab, (k,), generator=g)]
        out = _call(rejection_sample, (list(proposal), p[:k].clone(), p.clone(), g),
                    f"rejection_sample({proposal}, q=p, p) (q == p: every guess accepted)")
        if not isinstance(out, (list, tuple)) or len(out) != k + 1 or [int(t) for t in out[:k]] != proposal:
            raise CheckFailed(f"with q == p every proposal must be accepted (min(1, p/q) = 1) and a bonus token drawn "
                              f"from target_probs[k]: rejection_sample({proposal}, q=p, p) returned {out!r}")
    zero = p.clone()
    zero[0] = torch.tensor([0.0, 0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    q = torch.full((k, vocab), 1 / vocab, dtype=torch.float64)
    q[0] = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1], dtype=torch.float64)
    for _ in range(20):
        out = _call(rejection_sample, ([0, 1, 2], q.clone(), zero.clone(), g),
                    "rejection_sample([0, 1, 2], q, p) with p[0][0] = 0 (the first guess must be rejected)")
        if not isinstance(out, (list, tuple)) or len(out) != 1 or int(out[0]) == 0:
            raise CheckFailed(f"the target gives token 0 probability 0 at position 0, so proposal [0, 1, 2] must be "
                              f"rejected at once and a token other than 0 drawn from the residual: got {out!r}")
    out = _call(rejection_sample, ([], torch.zeros(0, vocab, dtype=torch.float64), p[:1].clone(), g),
                "rejection_sample([], q of shape [0, 5], p of shape [1, 5]) (an empty proposal)")
    if not isinstance(out, (list, tuple)) or len(out) != 1:
        raise CheckFailed(f"an empty proposal is a plain step: one token drawn from target_probs[0]; got {out!r}")
    # the degenerate case: q(x) = 0 (the draft could not have proposed x) rejects x, and with p == q the
    # residual max(p - q, 0) sums to zero: the replacement is drawn from p itself
    same = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0], [0.2] * 5], dtype=torch.float64)
    for _ in range(20):
        out = _call(rejection_sample, ([2], same[:1].clone(), same.clone(), g),
                    "rejection_sample([2], q = p = [0.5, 0.5, 0, 0, 0]) (q(2) = 0, and the residual sums to zero)")
        if not isinstance(out, (list, tuple)) or len(out) != 1 or int(out[0]) not in (0, 1):
            raise CheckFailed(f"q(2) = 0 = p(2): the guess 2 is rejected (a token the target never emits), and as "
                              f"p == q the residual sums to zero, so the replacement is drawn from p (token 0 or 1) "
                              f"— one token; got {out!r}")
    passed("rejection_sample corners", 61)


def check_rejection_sample(rejection_sample: Callable, num_rounds: int = 3000, seed: int = 0, vocab: int = 6,
                           k: int = 3, far: bool = True) -> None:
    """The chi-square test: tokens emitted at every position follow the target's p."""
    report = chi_square_report(rejection_sample, num_rounds, vocab, k, seed, far)
    for r in report["rows"]:
        if not math.isnan(r["p_value"]) and r["p_value"] < ALPHA:
            wrong = chi_square_report(skip_correction_sample, num_rounds, vocab, k, seed, far)["rows"][r["position"]]
            near = max(abs(a - b) for a, b in zip(r["observed"], wrong["observed"])) < 0.03
            hint = ("your frequencies match a sampler that draws the replacement from p itself: after a rejection draw "
                    "from normalize(max(p - q, 0)), the residual, or the tokens q over-proposes come out twice"
                    if near else "accept with probability min(1, p(x) / q(x)), draw a rejection's replacement from "
                    "normalize(max(p - q, 0)), and the bonus token from target_probs[k]")
            raise CheckFailed(f"chi-square test at position {r['position']}: the emitted tokens' frequencies "
                              f"{[round(v, 3) for v in r['observed']]} do not follow the target's "
                              f"{[round(v, 3) for v in r['target']]} (p-value {r['p_value']:.2g} < {ALPHA}): {hint}")
    passed(f"rejection_sample chi-square (k = {k}, {num_rounds} rounds)", k + 1)


def distribution_figure(report: dict, wrong: dict | None = None, position: int = 0):
    """Observed vs target frequencies at one position (and the skip-correction sampler's)."""
    fig = new_figure(f"Tokens emitted at position {position}: your sampler vs the target p",
                     "token id", "frequency", device="model: synthetic vocabulary, context-free p and q")
    x = list(range(report["vocab"]))
    fig.add_bar(x=x, y=report["rows"][position]["target"], name="target p")
    fig.add_bar(x=x, y=report["rows"][position]["observed"], name=f"yours (p = {report['rows'][position]['p_value']:.2g})")
    if wrong is not None:
        fig.add_bar(x=x, y=wrong["rows"][position]["observed"],
                    name=f"skips the correction (p = {wrong['rows'][position]['p_value']:.2g})")
    fig.add_bar(x=x, y=report["q"][position].tolist(), name="draft q", marker_opacity=0.4)
    fig.update_layout(barmode="group")
    return fig


# =================================================================== 6. the k sweep
def check_expected_tokens_per_pass(fn: Callable) -> None:
    cases = [(0.0, 4), (0.5, 1), (0.5, 3), (0.8, 8), (0.9, 2), (1.0, 5), (1.0, 1), (0.3, 0), (0.999, 6)]
    for alpha, k in cases:
        want = float(sum(alpha ** i for i in range(k + 1)))
        got = _call(fn, (alpha, k), f"expected_tokens_per_pass({alpha}, {k})",
                    "alpha may be 0 or 1 (the closed form (1 - a^(k+1)) / (1 - a) divides by zero at a = 1: "
                    "there every guess is kept, k + 1 tokens)" if alpha == 1.0 else "")
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-6):
            hint = "E = 1 + a + a^2 + ... + a^k: the target's own token always comes, the i-th proposal with a^i"
            if isinstance(got, (int, float)) and not isinstance(got, bool):
                if math.isclose(got, want - alpha ** k, rel_tol=1e-6, abs_tol=1e-12):
                    hint = "you summed k terms; there are k + 1 (a round ends with the target's own token)"
                elif math.isclose(got, want - 1, rel_tol=1e-6, abs_tol=1e-12):
                    hint = "you counted the accepted proposals only; the target's own token (1) comes every pass"
            raise CheckFailed(f"expected_tokens_per_pass({alpha}, {k}) returned {got!r}, expected {want:.6g}: {hint}")
    passed("expected_tokens_per_pass", len(cases))


TOKENS_LIMIT_ALPHA = 0.8   # the short answer: expected_tokens_per_pass(0.8, k) as k grows


def check_answer_tokens_limit(value) -> None:
    """answer_tokens_limit: the limit of 1 + a + ... + a^k as k grows, for a = TOKENS_LIMIT_ALPHA."""
    alpha = TOKENS_LIMIT_ALPHA
    want = 1 / (1 - alpha)   # the geometric series 1 + a + a^2 + ... (it converges: a < 1)
    case = f"answer_tokens_limit (alpha = {alpha}, k -> infinity)"
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"{case} is {value!r}; set it to a number (a float)")
    if is_close(value, want, rel=1e-3):
        passed("answer_tokens_limit", 1)
        return
    if math.isinf(value) or value > 100:
        hint = ("the series does not grow without bound: the i-th guess adds alpha^i, terms that shrink "
                "geometrically, so the sum converges to 1 / (1 - alpha)")
    elif is_close(value, alpha / (1 - alpha), rel=1e-3):
        hint = ("that counts only the accepted guesses (alpha + alpha^2 + ... = alpha / (1 - alpha)); every pass "
                "also yields the target's own token, + 1")
    elif is_close(value, 1 / alpha, rel=1e-3) or is_close(value, 1 - alpha, rel=1e-3):
        hint = "the limit of 1 + a + a^2 + ... is 1 / (1 - a): 1 / (1 - alpha), not 1 / alpha or 1 - alpha"
    elif value < 1:
        hint = "a pass always yields at least one token (the target's own), so the limit is at least 1"
    else:
        hint = ("sum the geometric series 1 + a + a^2 + ...: 1 / (1 - a) (check it with "
                "expected_tokens_per_pass(0.8, 200))")
    raise CheckFailed(f"{case} = {value!r} is not the limit: {hint}")


def available_methods() -> tuple[str, ...]:
    """The proposers this engine has built ("ngram"; "self" once the early-exit draft lands)."""
    from ..config import SPECULATIVE_METHODS

    return tuple(m for m in ("ngram", "self") if m in SPECULATIVE_METHODS)


def _run_requests(engine, requests, label: str, progress) -> dict:
    run = {"label": label, "decode_s": 0.0, "decode_tokens": 0, "outputs": [], "proposed": 0, "accepted": 0,
           "passes": 0, "emitted": 0}
    for req in requests:   # one after another: batch 1
        out = engine.generate(req.prompt, req.params, use_tqdm=False)[0]
        n = len(out.outputs[0].token_ids)
        if n > 1 and out.metrics.tpot_s is not None:
            run["decode_s"] += out.metrics.tpot_s * (n - 1)
            run["decode_tokens"] += n - 1
        run["outputs"].append(list(out.outputs[0].token_ids))
        spec = engine.stats.spec
        for key, attr in (("proposed", "num_proposed"), ("accepted", "num_accepted"), ("passes", "num_passes"),
                          ("emitted", "num_emitted")):
            run[key] += getattr(spec, attr)
        progress.update(1)
    return run


def sweep(llm, settings, num_requests: int = 4, max_tokens: int = 96, requests=None) -> dict:
    """Batch-1 greedy decode: speculation off, then each (method, k) of `settings`, on the repeat
    workload of `minillm bench --workload repeat` (or on `requests`). Same weights throughout."""
    from tqdm.auto import tqdm

    from ..bench.speculative import repeat_workload
    from ..bench.workloads import Request

    requests = requests or repeat_workload(llm, num_requests=num_requests, max_tokens=max_tokens)
    engines = [("off", None, 0, llm.with_levers(speculative=None))]
    engines += [(f"{m} k={k}", m, k, llm.with_levers(speculative=m, num_speculative_tokens=k)) for m, k in settings]
    warm = Request({"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=4, ignore_eos=True))
    runs = []
    with tqdm(total=len(engines) * len(requests), desc="speculative decoding runs") as progress:
        for label, method, k, engine in engines:
            engine.generate(warm.prompt, warm.params, use_tqdm=False)   # first-call overheads out of the timings
            run = _run_requests(engine, requests, label, progress)
            run.update(method=method, k=k)
            runs.append(run)
    base = runs[0]
    for r in runs:
        r["identical"] = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
    return {"device": llm.engine.device_label, "runs": runs, "num_requests": len(requests),
            "output_tokens": sum(len(o) for o in base["outputs"])}


RUN_COUNTERS = ("decode_s", "decode_tokens", "passes", "emitted", "proposed", "accepted")


def print_runs(result: dict) -> None:
    """The sweep's raw counters, one line per run: what spec_rates(run, base) reads."""
    print(f"batch 1 on {result['device']}: {result['num_requests']} requests, {result['output_tokens']} greedy "
          "output tokens; spec_sweep['runs'][i] holds:")
    print(f"{'label':12}{'k':>3}{'decode_s':>10}{'decode_tokens':>15}{'passes':>8}{'emitted':>9}{'proposed':>10}"
          f"{'accepted':>10}{'identical':>11}")
    for r in result["runs"]:
        print(f"{r['label']:12}{r['k']:>3}{r['decode_s']:>10.3f}{r['decode_tokens']:>15}{r['passes']:>8}"
              f"{r['emitted']:>9}{r['proposed']:>10}{r['accepted']:>10}{r['identical']:>8}/{result['num_requests']}")


def _ref_spec_rates(run: dict, base: dict) -> dict:
    """The reference of the learner's spec_rates (for grading)."""
    passes = run["passes"] if run["k"] > 0 else run["decode_tokens"]
    base_step_s = base["decode_s"] / base["decode_tokens"]
    return {"acceptance_rate": run["accepted"] / run["proposed"] if run["proposed"] else float("nan"),
            "tokens_per_pass": run["emitted"] / passes if run["k"] > 0 else 1.0,
            "pass_cost": (run["decode_s"] / passes) / base_step_s,
            "speedup": (run["decode_tokens"] / run["decode_s"]) / (base["decode_tokens"] / base["decode_s"])}


RATES = ("acceptance_rate", "tokens_per_pass", "pass_cost", "speedup")


def sweep_rows(result: dict, spec_rates: Callable) -> dict:
    """The sweep's table: each run's rates from the learner's spec_rates(run, base = the first run)."""
    base = result["runs"][0]
    rows = []
    for r in result["runs"]:
        rates = _call(spec_rates, (r, base), f"spec_rates(run {r['label']!r}, base {base['label']!r})")
        rows.append({"label": r["label"], "method": r["method"], "k": r["k"],
                     "decode_tok_per_s": r["decode_tokens"] / r["decode_s"] if r["decode_s"] else float("nan"),
                     **{key: float(rates[key]) for key in RATES}, "identical": r["identical"], "run": r})
    return {**{key: value for key, value in result.items() if key != "runs"}, "rows": rows}


# synthetic runs where every usual mistake gives another number (decode_tokens == emitted, as in the engine)
_BASE_RUN = {"label": "off", "method": None, "k": 0, "decode_s": 2.0, "decode_tokens": 40, "passes": 0,
             "emitted": 0, "proposed": 0, "accepted": 0}
_SYNTHETIC_RUNS = [
    dict(_BASE_RUN),
    dict(_BASE_RUN, label="ngram k=4", method="ngram", k=4, decode_s=1.0, passes=16, emitted=40, proposed=64,
         accepted=24),
    dict(_BASE_RUN, label="ngram k=4 (open)", method="ngram", k=4, decode_s=3.0, passes=38, emitted=40,
         proposed=120, accepted=2),
    dict(_BASE_RUN, label="ngram k=2 (no match)", method="ngram", k=2, decode_s=2.2, passes=40, emitted=40,
         proposed=0, accepted=0),
]


def _rates_hint(key: str, got: float, run: dict, base: dict) -> str:
    want = _ref_spec_rates(run, base)[key]
    passes = run["passes"] if run["k"] > 0 else run["decode_tokens"]
    if key == "speedup":
        if is_close(got, 1 / want, rel=1e-6):
            return ("you divided the wrong way: speed-up = this run's tokens per second / speculation off's "
                    "(above 1 when speculation is faster)")
        return "speed-up = (decode_tokens / decode_s of this run) / (decode_tokens / decode_s of speculation off)"
    if key == "tokens_per_pass":
        if run["k"] > 0 and is_close(got, run["accepted"] / passes, rel=1e-6):
            return ("you counted the accepted guesses only: every pass also yields the target's own token "
                    "(emitted = accepted + passes), so divide emitted by passes")
        if run["k"] == 0:
            return "speculation off (k = 0): every decode pass yields exactly one token, so 1.0"
        return "tokens per pass = emitted / passes (target passes of the speculating run)"
    if key == "acceptance_rate":
        if run["proposed"] == 0:
            return "nothing was proposed: the acceptance rate is undefined, float('nan') (no division by zero)"
        if is_close(got, run["accepted"] / run["emitted"], rel=1e-6):
            return "acceptance = accepted / proposed (of the guesses, how many were kept), not / emitted"
        if is_close(got, run["accepted"] / passes, rel=1e-6):
            return "acceptance = accepted / proposed, not accepted guesses per pass"
        return "acceptance = accepted / proposed"
    # pass_cost
    base_step_s = base["decode_s"] / base["decode_tokens"]
    if is_close(got, (run["decode_s"] / run["emitted"] if run["emitted"] else float("nan")) / base_step_s, rel=1e-6):
        return ("that is seconds per emitted token; the pass cost is seconds per target pass (decode_s / passes) "
                "over seconds per plain decode step")
    if is_close(got, 1 / want, rel=1e-6):
        return ("you divided the wrong way: pass cost = (this run's seconds per pass) / (one plain decode "
                "step's seconds)")
    if run["k"] == 0:
        return "speculation off (k = 0): passes = decode_tokens (the counters count speculative passes only), cost 1.0"
    return "pass cost = (decode_s / passes) / (base decode_s / base decode_tokens)"


def check_spec_rates(spec_rates: Callable, result: dict | None) -> None:
    """The learner's rates, recomputed from the raw counters of their own sweep (`result`, from sweep), then
    from synthetic runs where each usual mistake gives a different number."""
    if result is None or not result.get("runs"):
        raise CheckFailed("spec_sweep is None: run the sweep cell above")
    cases = [(r, result["runs"][0]) for r in result["runs"]] + [(r, _BASE_RUN) for r in _SYNTHETIC_RUNS]
    for run, base in cases:
        call = f"spec_rates(run {run['label']!r}, base {base['label']!r})"
        got = _call(spec_rates, (dict(run), dict(base)), call,
                    "with k = 0 the counters hold no speculative passes (passes = 0): every decode token was one "
                    "plain pass" if run["k"] == 0 else "")
        if not isinstance(got, dict) or set(RATES) - set(got):
            raise CheckFailed(f"{call} returned {got!r}; expected a dict with the keys {list(RATES)}")
        want = _ref_spec_rates(run, base)
        for key in RATES:
            value = got[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
                raise CheckFailed(f"{call}[{key!r}] is {value!r}; expected a number, {want[key]:.4g}")
            value = float(value)
            ok = math.isnan(value) if math.isnan(want[key]) else is_close(value, want[key], rel=1e-6)
            if not ok:
                raise CheckFailed(f"{call}[{key!r}] = {value:.4g}, expected {want[key]:.4g} ({_describe_run(run)}): "
                                  + _rates_hint(key, value, run, base))
    passed("spec_rates", len(cases))


def _describe_run(run: dict) -> str:
    return ", ".join(f"{key} = {run[key]}" for key in ("k",) + RUN_COUNTERS)


def print_sweep(result: dict) -> None:
    n = result["num_requests"]
    print(f"batch 1 on {result['device']}: {n} requests, {result['output_tokens']} greedy output tokens")
    print(f"{'setting':12}{'tok/s':>9}{'speed-up':>10}{'acceptance':>12}{'tokens/pass':>13}{'pass cost':>11}{'identical':>11}")
    for row in result["rows"]:
        acc = "" if row["k"] == 0 else f"{row['acceptance_rate']:.1%}"
        tpp = 1.0 if row["k"] == 0 else row["tokens_per_pass"]
        print(f"{row['label']:12}{row['decode_tok_per_s']:>9.1f}{row['speedup']:>9.2f}x{acc:>12}{tpp:>13.2f}"
              f"{row['pass_cost']:>10.2f}x{row['identical']:>8}/{n}")
    print("pass cost: seconds per decode pass (draft passes included) relative to a plain one-token decode step")


def sweep_figure(result: dict, device: str):
    """Acceptance rate against speed-up, one point per k."""
    rows = [r for r in result["rows"] if r["k"]]
    fig = new_figure("Speculative decoding (ngram): acceptance rate vs speed-up, batch 1", "acceptance rate",
                     "decode speed-up over speculation off", device=device)
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        fig.add_scatter(x=[r["acceptance_rate"] for r in mine], y=[r["speedup"] for r in mine],
                        mode="markers+text+lines", text=[f"k={r['k']}" for r in mine], textposition="top center",
                        name=method)
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="no speed-up")
    fig.update_xaxes(tickformat=".0%")
    return fig


def tokens_per_pass_figure(result: dict, device: str, expected_tokens_per_pass: Callable | None = None):
    """Tokens per pass, pass cost and speed-up against k (speed-up = tokens per pass / pass cost)."""
    rows = [r for r in result["rows"] if r["method"] in (None, "ngram")]
    ks = [r["k"] for r in rows]
    fig = new_figure("What k buys and what it costs (ngram)", "k (proposed tokens per pass; 0 = off)", "ratio", device=device)
    fig.add_scatter(x=ks, y=[1.0 if r["k"] == 0 else r["tokens_per_pass"] for r in rows], name="tokens per pass")
    fig.add_scatter(x=ks, y=[r["pass_cost"] for r in rows], name="pass cost (vs a one-token step)")
    fig.add_scatter(x=ks, y=[r["speedup"] for r in rows], name="speed-up")
    first = next((r for r in rows if r["k"] == 1), None)
    if expected_tokens_per_pass is not None and first is not None:
        alpha = first["acceptance_rate"]
        try:
            fig.add_scatter(x=ks, y=[expected_tokens_per_pass(alpha, k) for k in ks], line_dash="dash",
                            name=f"1 + a + ... + a^k, a = {alpha:.2f} (k = 1's acceptance)")
        except NotImplementedError:
            pass
    return fig


def open_workload(llm, num_requests: int, max_tokens: int):
    from ..bench.workloads import Request

    return [Request(open_prompt(llm, OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)]), SamplingParams(max_tokens=max_tokens))
            for i in range(num_requests)]


__all__ = ["plugged", "print_toy", "check_greedy_verify", "check_greedy_verify_edges",
           "check_ngram_propose", "check_ngram_edges", "print_plugged", "check_plugged",
           "synthetic_case", "chi_square_p_value", "chi_square_report", "print_chi_square",
           "check_rejection_sample", "check_rejection_sample_shape", "skip_correction_sample", "distribution_figure",
           "check_chi_square_test", "check_expected_tokens_per_pass", "check_answer_tokens_limit", "sweep",
           "print_runs", "sweep_rows", "check_spec_rates", "print_sweep", "sweep_figure", "tokens_per_pass_figure",
           "open_workload", "available_methods", "residual_distribution", "echo_prediction"]


# =================================================================== 4b. greedy verification as one kernel launch
def accept_lengths_reference(proposals: torch.Tensor, target_argmax: torch.Tensor,
                             num_proposed: torch.Tensor) -> torch.Tensor:
    """The kernel exercise's spec: proposals [B, K], target_argmax [B, K + 1], num_proposed [B] (int32) -> [B] int32,
    the number of leading proposed tokens equal to the target's argmax at their position (padding past
    num_proposed[b] never counts)."""
    k = proposals.shape[1]
    valid = torch.arange(k, device=proposals.device)[None, :] < num_proposed[:, None].long()
    agree = (proposals == target_argmax[:, :k]) & valid
    return agree.int().cumprod(dim=1).sum(dim=1).to(torch.int32)


def make_verify_inputs(num_proposed, k: int, vocab: int = 5, seed: int = 0, device: str = "cpu"):
    """A batch of padded proposals for the kernel: each row agrees with the target's argmax for a random number of
    leading positions, then differs once, then agrees at random again (a later agreement must not count). Padding
    past num_proposed[b] copies the target's argmax there, so a kernel that reads past the mask counts it."""
    g = torch.Generator().manual_seed(seed)
    batch = len(num_proposed)
    target = torch.randint(0, vocab, (batch, k + 1), generator=g, dtype=torch.int32)
    proposals = target[:, :k].clone()
    for b, n in enumerate(num_proposed):
        if not 0 <= n <= k:
            raise ValueError(f"num_proposed[{b}] = {n}: each must be in [0, k = {k}]")
        cut = int(torch.randint(0, n + 2, (1,), generator=g))   # n + 1: every guess agrees
        if cut < n and vocab > 1:   # a vocabulary of one token cannot disagree
            proposals[b, cut] = (target[b, cut] + 1 + int(torch.randint(0, vocab - 1, (1,), generator=g))) % vocab
            later = torch.rand(n - cut - 1, generator=g) < 0.3
            noise = torch.randint(1, vocab, (n - cut - 1,), generator=g, dtype=torch.int32)
            tail = torch.where(later, target[b, cut + 1:n], (target[b, cut + 1:n] + noise) % vocab)
            proposals[b, cut + 1:n] = tail
    lengths = torch.tensor(list(num_proposed), dtype=torch.int32)
    return proposals.to(device), target.to(device), lengths.to(device)


# (num_proposed per sequence, K, vocab, what the case is about)
VERIFY_CASES = [
    ([4, 4, 4, 4, 4, 4, 4, 4], 4, 3, "a full batch, k = 4"),
    ([3, 0, 8, 1, 5, 8, 2, 7, 6, 4], 8, 4, "ragged proposals padded to K = 8"),
    ([5, 2, 7, 7, 1, 3], 7, 2, "K = 7, not a power of 2"),
    ([16] * 3 + [9, 12], 16, 3, "K = 16, long agreeing runs"),
]
VERIFY_EDGE_CASES = [
    ([0, 0, 0], 4, 3, "no proposal at all (k_b = 0 for every sequence)"),
    ([1], 1, 2, "one sequence, one guess"),
    ([6, 6], 6, 1, "vocab of 1: every guess agrees, all accepted"),
]


def _diagnose_accept(proposals, target, lengths, got, want) -> str:
    k = proposals.shape[1]
    cols = torch.arange(k)[None, :]
    valid = cols < lengths[:, None].long()
    agree = proposals == target[:, :k]
    guesses = [
        ((agree & valid).int().sum(1), "you counted every agreeing guess: stop at the first disagreement (a later "
                                       "agreement was scored after a wrong token)"),
        (agree.int().cumprod(1).sum(1), "you counted padding past num_proposed[b] (mask the columns >= num_proposed[b])"),
        ((agree & (cols <= lengths[:, None].long())).int().cumprod(1).sum(1),
         "off by one: the mask keeps column num_proposed[b] too (use cols < num_proposed[b])"),
    ]
    flat_target = target.flatten()
    rows = torch.arange(proposals.shape[0])[:, None] * k + cols
    shifted = flat_target[rows.clamp_max(flat_target.numel() - 1)].reshape(proposals.shape)
    guesses.append((((proposals == shifted) & valid).int().cumprod(1).sum(1),
                    "wrong stride: a row of target_argmax has K + 1 entries, not K"))
    no_miss = torch.where(want.long() == lengths.long(), torch.zeros_like(want.long()), want.long())
    guesses.append((no_miss, "a sequence whose guesses all agree has no miss: its count is num_proposed[b] (the "
                             "sentinel of the min), not 0"))
    for value, why in guesses:
        if torch.equal(got.long(), value.long()) and not torch.equal(value.long(), want.long()):
            return why
    if (got < 0).any():
        return "a sequence's length was never stored (the output starts at -1)"
    if (got > lengths).any():
        return "more than num_proposed[b] accepted: the count must stop at the sequence's own guesses"
    return "not the leading run of agreeing guesses"


def check_accept_lengths(accept_lengths: Callable, cases=VERIFY_CASES, seed: int = 0, device: str | None = None) -> None:
    """Your launcher + kernel vs accept_lengths_reference on fresh random padded batches."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    for i, (num_proposed, k, vocab, why) in enumerate(cases):
        proposals, target, lengths = make_verify_inputs(num_proposed, k, vocab, seed=seed + 17 * i, device=device)
        call = f"accept_lengths(num_proposed={list(num_proposed)}, K={k}, vocab={vocab})"
        got = _call(accept_lengths, (proposals, target, lengths), call)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (len(num_proposed),):
            raise CheckFailed(f"{call} returned {getattr(got, 'shape', type(got).__name__)}; expected a tensor of "
                              f"shape ({len(num_proposed)},): one count per sequence")
        got = got.cpu()
        want = accept_lengths_reference(proposals.cpu(), target.cpu(), lengths.cpu())
        if not torch.equal(got.long(), want.long()):
            raise CheckFailed(f"{call} ({why}): got {got.tolist()}, expected {want.tolist()}; "
                              + _diagnose_accept(proposals.cpu(), target.cpu(), lengths.cpu(), got, want))
    passed("accept_lengths", len(cases))


class KernelVerifier:
    """A Verifier (minillm/seams.py) with greedy_batch: each speculative step's greedy sequences are padded into
    one [B, K] batch and verified by ONE call of your accept_lengths (one kernel launch); the kept tokens are the
    accepted prefix, then the target's own token. Sampled requests use the engine's rejection sampling."""

    def __init__(self, accept_lengths: Callable):
        self.accept_lengths = accept_lengths
        self.launches = 0
        self.sequences = 0
        self.kernel_s = 0.0
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    def greedy_batch(self, proposals: list[list[int]], target_argmax: list[list[int]]) -> list[list[int]]:
        import time

        k = max(1, max(len(p) for p in proposals))
        batch = len(proposals)
        props = torch.zeros(batch, k, dtype=torch.int32)
        target = torch.zeros(batch, k + 1, dtype=torch.int32)
        for b, (p, t) in enumerate(zip(proposals, target_argmax)):
            props[b, :len(p)] = torch.tensor(p, dtype=torch.int32)
            target[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        lengths = torch.tensor([len(p) for p in proposals], dtype=torch.int32)
        start = time.perf_counter()
        accepted = self.accept_lengths(props.to(self.device), target.to(self.device), lengths.to(self.device)).cpu()
        self.kernel_s += time.perf_counter() - start
        self.launches += 1
        self.sequences += batch
        out = []
        for b, (p, t) in enumerate(zip(proposals, target_argmax)):
            n = int(accepted[b])
            if not 0 <= n <= len(p):
                raise ValueError(f"accept_lengths returned {n} for a sequence of {len(p)} proposed tokens")
            out.append([int(x) for x in p[:n]] + [int(t[n])])
        return out

    def greedy(self, proposal: list[int], target_argmax: list[int]) -> list[int]:
        return self.greedy_batch([proposal], [target_argmax])[0]

    def sample(self, proposal: list[int], draft_probs, target_probs, generator) -> list[int]:
        return ref_rejection_sample(proposal, draft_probs, target_probs, generator=generator)


def print_kernel_verify_run(result: dict) -> None:
    """run_with_kernel's printout: tokens against the engine's own verifier and speculation off, launches."""
    from .common import print_kernel_run

    print_kernel_run(result, [("the engine's own verifier (speculating, same proposals)", result["engine_tokens"], ""),
                              ("speculation off", result["expected"], "")],
                     result["launches"], "your accept_lengths (one launch per speculative step)")
    print(f"  {result['sequences']} sequence verifications in {result['launches']} launches "
          f"({result['sequences'] / max(1, result['launches']):.1f} sequences per launch)")


def check_kernel_verify_run(result: dict | None) -> None:
    """The engine on your kernel: the same greedy tokens as its own verifier, one launch per step for the batch."""
    if result is None:
        raise CheckFailed("kernel_run is None: run the cell above (it runs the engine on your kernel)")
    for whose, key in (("the engine's own verifier", "engine_tokens"), ("speculation off", "expected")):
        for i, (got, want) in enumerate(zip(result["tokens"], result[key])):
            if got != want:
                where = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                raise CheckFailed(f"prompt {i}: your kernel's tokens differ from {whose}'s: they part at output "
                                  f"token {where} ({got[where:where + 3]} vs {want[where:where + 3]})")
    if result["launches"] == 0:
        raise CheckFailed("your kernel was never launched: the engine did not speculate")
    if not result["acceptance_rate"] > 0:
        raise CheckFailed("the tokens are right, but no proposed token was accepted: the repeat prompt's guesses agree "
                          "with the target (the engine's own verifier accepts them), so your counts are too low")
    if result["sequences"] <= result["launches"]:
        raise CheckFailed(f"{result['sequences']} verifications in {result['launches']} launches: with "
                          f"{len(result['tokens'])} prompts in one batch a launch must verify several sequences")
    passed("the engine on your kernel", len(result["tokens"]))


def time_accept_kernel(accept_lengths: Callable, batch: int = 256, k: int = 8) -> dict:
    """On a GPU: your kernel against the torch spec on a [batch, k] step (one launch vs a handful of torch ops)."""
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    from .common import gpu_seconds

    inputs = make_verify_inputs([k] * batch, k, vocab=4, device="cuda")
    return {"device": torch.cuda.get_device_name(), "batch": batch, "k": k,
            "yours_s": gpu_seconds(lambda: accept_lengths(*inputs)),
            "torch_s": gpu_seconds(lambda: accept_lengths_reference(*inputs))}


def print_accept_kernel_timing(timing: dict) -> None:
    from .common import format_seconds, print_no_gpu_timing

    if timing["device"] == "cpu":
        print_no_gpu_timing("on a batch of 256 sequences with 8 guesses each, against the torch spec (cumprod)")
        return
    print(f"{timing['device']}: batch {timing['batch']}, k = {timing['k']}")
    print(f"  your kernel: {format_seconds(timing['yours_s'])} (one launch)")
    print(f"  torch spec : {format_seconds(timing['torch_s'])} (one launch per op: compare, mask, cumprod, sum)")


# =================================================================== 6b. the learner's timing harness
# The reference run: `lab07.REFERENCE_SPEEDUP` came from the notebook's measurement cell in full mode
# (time_speculation on the two repeat prompts, SamplingParams(max_tokens=48, temperature=0), ngram k = 4, warmup 1,
# repeats 3) on this course's reference machine, shared with other jobs at the time (absolute tokens/s low; 47
# tokens per call: one answer stopped at its end of sentence).
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
REFERENCE_TOKENS_PER_S = {"off": 2.3, "on": 8.8}   # median tokens/s of a call, speculation off / ngram k = 4
REFERENCE_SPEEDUP = 3.8                            # on over off


class FakeCompletion:
    """What a fake engine's output holds, reachable from the sandbox by its attributes (not a dataclass: the
    learner reads `out.outputs[0].token_ids` through the grader's handle)."""

    __sandbox_methods__ = ()
    __sandbox_attributes__ = ("token_ids", "text")

    def __init__(self, num_tokens: int):
        self.token_ids, self.text = list(range(num_tokens)), ""


class FakeRequestOutput:
    __sandbox_methods__ = ()
    __sandbox_attributes__ = ("outputs",)

    def __init__(self, num_tokens: int):
        self.outputs = [FakeCompletion(num_tokens)]


class FakeSpecEngine:
    """A stand-in for an engine in the harness check: each generate() call moves the shared FakeClock by the next
    scripted cost and returns `tokens` output tokens per prompt (as RequestOutputs)."""

    __sandbox_methods__ = ("generate",)
    __sandbox_attributes__ = ()

    def __init__(self, clock, costs, tokens: int):
        self.clock, self.costs, self.tokens, self.calls = clock, list(costs), tokens, 0

    def generate(self, prompts, params=None, use_tqdm=True):
        if self.calls >= len(self.costs):
            raise RuntimeError(f"generate() called {self.calls + 1} times; warmup + repeats is {len(self.costs)}")
        self.clock.advance(self.costs[self.calls])
        self.calls += 1
        prompts = prompts if isinstance(prompts, list) else [prompts]
        return [FakeRequestOutput(self.tokens) for _ in range(len(prompts))]


def _harness_case(warmup: int, repeats: int, seed: int):
    from .common import FakeClock, scripted_costs

    clock = FakeClock()
    costs = {"off": scripted_costs(0.8, warmup, repeats, seed), "on": scripted_costs(0.3, warmup, repeats, seed + 1)}
    engines = {name: FakeSpecEngine(clock, costs[name], tokens=24) for name in costs}
    return clock, costs, engines


def check_time_speculation(time_speculation: Callable, warmup: int = 2, repeats: int = 5, seed: int = 0) -> None:
    """Your harness with a FakeClock and fake engines whose calls cost scripted seconds: warm-up calls dropped, the
    median (and min, max) of each engine's timed calls, tokens per second, and the speed-up on over off."""
    import statistics

    from .common import timing_mistake

    clock, costs, engines = _harness_case(warmup, repeats, seed)
    prompts = ["a", "b"]
    call = f"time_speculation(engines, 2 prompts, params, warmup={warmup}, repeats={repeats}, clock=FakeClock)"
    params = {"max_tokens": 24, "temperature": 0}   # the fake engines ignore it; plain data crosses
    got = _call(lambda: time_speculation(engines, prompts, params, warmup=warmup, repeats=repeats, clock=clock), (),
                call)
    if clock.reads == 0:
        raise CheckFailed(f"{call}: the clock it was given was never read: time each call with clock(), not "
                          "time.perf_counter() (the injected clock is what the check and your plot see)")
    for name, engine in engines.items():
        if engine.calls != warmup + repeats:
            raise CheckFailed(f"{call}: engine {name!r}'s generate() ran {engine.calls} times; expected warmup + "
                              f"repeats = {warmup + repeats}")
    if not isinstance(got, dict) or not all(isinstance(got.get(n), dict) for n in ("off", "on")) or "speedup" not in got:
        raise CheckFailed(f"{call} returned {type(got).__name__}; expected a dict with 'off', 'on' (dicts) and 'speedup'")
    tokens = 2 * 24
    for name in ("off", "on"):
        timed = costs[name][warmup:]
        want = {"median_s": statistics.median(timed), "min_s": min(timed), "max_s": max(timed), "tokens": tokens,
                "tokens_per_s": tokens / statistics.median(timed)}
        for key, value in want.items():
            have = got[name].get(key)
            if not isinstance(have, (int, float)) or not is_close(float(have), value, rel=1e-6):
                why = timing_mistake(float(have), costs[name], warmup) if key == "median_s" and isinstance(
                    have, (int, float)) else ""
                if key == "tokens" and isinstance(have, (int, float)) and have == 24:
                    why = "the tokens of one prompt: sum the output tokens over every prompt of the call"
                raise CheckFailed(f"{call}: [{name!r}][{key!r}] is {have!r}, expected {value:.6g}"
                                  + (f": {why}" if why else ""))
    want = statistics.median(costs["off"][warmup:]) / statistics.median(costs["on"][warmup:])
    have = got["speedup"]
    if not isinstance(have, (int, float)) or not is_close(float(have), want, rel=1e-6):
        why = ": inverted — speed-up is on tokens/s over off tokens/s (above 1: speculation is faster)" if (
            isinstance(have, (int, float)) and have and is_close(1 / float(have), want, rel=1e-6)) else ""
        raise CheckFailed(f"{call}: speedup is {have!r}, expected {want:.6g}{why}")
    passed("time_speculation", 1)


def timing_figure(timing: dict, device: str):
    """Tokens per second, speculation off and on: the median as a bar, the min-max spread as an error bar."""
    import plotly.graph_objects as go

    names = ["off", "on"]
    fig = new_figure("Decode speed, speculation off vs on (your harness)", "", "output tokens / s", device)
    med = [timing[n]["tokens_per_s"] for n in names]
    high = [timing[n]["tokens"] / timing[n]["min_s"] for n in names]
    low = [timing[n]["tokens"] / timing[n]["max_s"] for n in names]
    fig.add_trace(go.Bar(x=["speculation off", "ngram on"], y=med, name="median",
                         error_y={"type": "data", "symmetric": False, "array": [h - m for h, m in zip(high, med)],
                                  "arrayminus": [m - lo for m, lo in zip(med, low)]}))
    fig.add_trace(go.Bar(x=["speculation off", "ngram on"], y=[REFERENCE_TOKENS_PER_S[n] for n in names],
                         name=f"reference ({REFERENCE_HARDWARE})"))
    return fig


def _fmt(value, spec: str, missing: str = "(not measured)") -> str:
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return missing


def print_explain_questions(spec_rows: dict | None, spec_timing: dict | None, kernel_run: dict | None) -> None:
    """Section 8's questions, each quoting the learner's own measurement."""
    rows = [r for r in (spec_rows or {}).get("rows", []) if r.get("method") == "ngram"]
    k4 = next((r for r in rows if r["k"] == 4), rows[-1] if rows else None)
    last = rows[-1] if rows else None
    k_label = k4["k"] if k4 else 4
    print(f"1. At k = {k_label} your pass cost was {_fmt(k4 and k4['pass_cost'], '.2f')} plain decode steps per pass "
          f"(at k = {last['k'] if last else '?'}: {_fmt(last and last['pass_cost'], '.2f')}). Why does scoring k + 1 "
          "positions cost about one step on a GPU, and why did it cost you more here?")
    print("2. Your greedy output was identical with and without speculation (the engine cells checked it). What "
          "guarantees that, and what is the weaker guarantee when sampling?")
    print("3. In the chi-square check, the sampler that drew replacements from p failed. Which tokens did it emit too "
          "often, and why?")
    print(f"4. Your acceptance rate at k = {k_label} was {_fmt(k4 and k4['acceptance_rate'], '.0%')} with "
          f"{_fmt(k4 and k4['tokens_per_pass'], '.2f')} tokens per pass and a decode speed-up of "
          f"{_fmt(k4 and k4['speedup'], '.2f')}x. At batch size 64 a decode pass is close to compute-bound: which of "
          "these three numbers changes, and what happens to the speed-up?")
    t = spec_timing or {}
    print(f"5. Your harness timed {_fmt(t.get('off', {}).get('tokens_per_s'), '.1f')} tokens/s off and "
          f"{_fmt(t.get('on', {}).get('tokens_per_s'), '.1f')} tokens/s on, a speed-up of {_fmt(t.get('speedup'), '.2f')}x "
          f"(reference {REFERENCE_SPEEDUP:.2f}x on {REFERENCE_HARDWARE}). Why is it not the sweep's decode speed-up "
          f"at k = {k_label} ({_fmt(k4 and k4['speedup'], '.2f')}x)?")
    r = kernel_run or {}
    per_launch = r["sequences"] / r["launches"] if r.get("launches") else None
    print(f"6. Your kernel verified {_fmt(per_launch, '.1f')} sequences per launch in {r.get('launches', '?')} "
          "launches. What does fusing the verifier save per step at batch 64 on a GPU, and why does it not show here?")


class TimedEngine:
    """A real engine handed to the learner's harness from the grader's kernel (the engine's own parts are references
    the sandbox does not have): generate() runs it with the SamplingParams it was made with (the harness's `params`
    argument, None here, is ignored) and returns outputs whose `outputs[0].token_ids` the harness counts."""

    __sandbox_methods__ = ("generate",)
    __sandbox_attributes__ = ()

    def __init__(self, engine, params):
        self.engine, self.params = engine, params

    def generate(self, prompts, params=None, use_tqdm=True):
        outs = self.engine.generate(prompts, self.params, use_tqdm=False)
        return [FakeRequestOutput(len(o.outputs[0].token_ids)) for o in outs]
