"""Lab 09 helpers — decoding settings: checks of the learner's `process_logits` (against the engine's sampler,
minillm/layers/sampler.py), the chi-square of their sampler's draws, the recording sampler and printouts of
the temperature / top-p sweep, its figures and widget, the checks of `diversity_stats`, the short answer and
`valid_person`, and the printouts of the stop / max_tokens, parallel-sampling and structured-output runs (the
experiments themselves are defs in the notebook).

The learner writes, with fixed signatures:

    process_logits(logits, history, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
        -> probabilities [V]                      # what the engine's sampler draws from, for one row
    diversity_stats(run) -> {distinct_2, repetition, mean_entropy}   # a measurement: a sweep run's raw samples
    answer_worst_case_usd: float                  # a short answer: what n and max_tokens bound
    valid_person(text) -> bool                    # does the text hold a JSON object of the lab's schema

Every check calls the learner's code through `call_learner`, so a crash is a CheckFailed that names the call.
The engine takes a sampler as a part (`llm.with_levers(sampler=...)`, the Sampler protocol of minillm/seams.py):
the notebook's `LearnerSampler` calls `process_logits` on each row of the batch and draws with the row's generator.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence

import torch

from ..layers.sampler import SamplingBatch, TorchSampler, processed_probs
from ..sampling import SamplingParams
from .common import CheckFailed, call_learner, echo_prediction, format_seconds, new_figure, passed, require_kernel  # noqa: F401
from .common import chat_prompts, chi_square_p_value  # noqa: F401 - the notebook builds its prompts as lab09.chat_prompts

_call = call_learner   # lab/common.py

STORY_MESSAGES = [{"role": "user", "content": "Write a short story about a dragon who is afraid of the dark."}]
LIST_MESSAGES = [{"role": "user", "content": "List ten animals that live in the sea, one per line, numbered 1. to 10."}]
API_USD_PER_MTOK = 0.60   # an example price list: USD per million output tokens of a small hosted model
WORST_CASE = {"n": 4, "max_tokens": 500, "usd_per_mtok": API_USD_PER_MTOK}   # the short answer's request

ATOL = 1e-6   # "equal" distributions: the same tokens above 0, each probability within ATOL of the reference's


# =================================================================== 1. the reference and the distribution
def reference_probs(logits: torch.Tensor, history: Sequence[int], temperature: float = 1.0, top_k: int = -1,
                    top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0) -> torch.Tensor:
    """The engine's own processing of one row (minillm.layers.sampler.processed_probs): the distribution the
    learner's process_logits must return."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty)
    batch = SamplingBatch([params], [None], [list(history)], [[]])
    return processed_probs(logits.detach().float().reshape(1, -1).clone(), batch)[0]


class LogitsRecorder:
    """A Sampler (minillm/seams.py) that keeps the raw logits and the SamplingBatch of every call, then samples as
    the engine does."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, SamplingBatch]] = []
        self.reference = TorchSampler()

    def sample(self, logits, batch) -> list[int]:
        self.calls.append((logits.detach().cpu().clone(), batch))
        return self.reference.sample(logits, batch)


def first_token_logits(llm, messages=STORY_MESSAGES) -> dict:
    """The raw logits of the first answer token of a chat prompt (a recording sampler plugged in for one step)."""
    recorder = LogitsRecorder()
    engine = llm.with_levers(sampler=recorder)
    ids = llm.chat_token_ids(messages)
    engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    return {"logits": recorder.calls[0][0][0], "prompt_token_ids": ids, "tokenizer": llm.tokenizer,
            "question": messages[-1]["content"]}


def print_distribution(first: dict, settings: Sequence[dict], top: int = 8) -> None:
    """For each setting (keyword arguments of process_logits), the tokens the engine keeps and the most likely
    ones' probabilities, from the engine's own processing."""
    tok = first["tokenizer"]
    print(f"the first token of the answer to {first['question']!r}:")
    for setting in settings:
        probs = reference_probs(first["logits"], first["prompt_token_ids"], **setting)
        kept = int((probs > 0).sum())
        values, ids = probs.topk(top)
        shown = "  ".join(f"{tok.decode([int(i)])!r} {float(v):.3f}" for v, i in zip(values, ids) if v > 0)
        entropy = _entropy(probs)
        print(f"  {describe(setting):38} keeps {kept:>6} tokens, entropy {entropy:.2f} nats: {shown}")


def kept_tokens(first: dict, **setting) -> int:
    """How many tokens the engine's processing keeps (probability above 0) for the first token."""
    return int((reference_probs(first["logits"], first["prompt_token_ids"], **setting) > 0).sum())


def describe(setting: dict) -> str:
    """'temperature 0.7, top_p 0.9' for a dict of settings ('raw' when empty)."""
    return ", ".join(f"{key} {value}" for key, value in setting.items()) or "raw (temperature 1)"


def _entropy(probs: torch.Tensor) -> float:
    p = probs.double()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


# =================================================================== 2. process_logits against the reference
SETTINGS_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _as_probs(got, vocab: int, call: str) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{call} returned {type(got).__name__}; return a torch tensor of {vocab} probabilities")
    if got.shape != (vocab,):
        raise CheckFailed(f"{call} returned a tensor of shape {tuple(got.shape)}; expected ({vocab},): one "
                          "probability per token of the row")
    got = got.detach().double()
    if torch.isnan(got).any():
        raise CheckFailed(f"{call} returned NaN probabilities: a softmax over a row that is all -inf? (the most "
                          "likely token always stays), or 0 * inf from the penalty")
    return got


def _case_call(logits, history, setting) -> str:
    shown = [f"{v:.3g}" if math.isfinite(v) else str(v) for v in logits.tolist()] if logits.numel() <= 8 else None
    row = f"[{', '.join(shown)}]" if shown else f"<{logits.numel()} logits>"
    hist = history if len(history) <= 8 else f"<{len(history)} ids>"
    args = ", ".join(f"{k}={v}" for k, v in setting.items())
    return f"process_logits({row}, history={hist}" + (f", {args})" if args else ")")


def _variants(logits, history, setting) -> dict:
    """What the usual mistakes return on one case (for the hints)."""
    s = {key: setting.get(key, default) for key, default in
         zip(SETTINGS_KEYS, (1.0, -1, 1.0, 0.0, 1.0))}
    out = {}
    hist = list(history)
    r = s["repetition_penalty"]
    if r != 1.0 and hist:
        # the penalty divides every seen logit (a negative one then rises)
        lg = logits.clone()
        seen = torch.tensor(sorted(set(hist)))
        lg[seen] = lg[seen] / r
        out["divides negative logits too"] = _filtered_probs(lg, s)
        # once per occurrence, not once per token
        lg = logits.clone()
        for t in hist:
            lg[t] = lg[t] / r if lg[t] > 0 else lg[t] * r
        out["applied once per occurrence"] = _filtered_probs(lg, s)
        # the other way round
        lg = logits.clone()
        lg[seen] = torch.where(lg[seen] > 0, lg[seen] * r, lg[seen] / r)
        out["the wrong way round"] = _filtered_probs(lg, s)
    pen = _penalized(logits, hist, r)
    if s["temperature"] != 0:
        if s["top_p"] < 1.0:
            out["top_p drops the crossing token"] = _filtered_probs(pen, s, crossing=False)
            out["top_p before top_k"] = _filtered_probs(pen, s, p_first=True)
        if s["min_p"] > 0:
            out["min_p absolute"] = _filtered_probs(pen, s, min_p_absolute=True)
        if s["temperature"] != 1.0 and (s["top_p"] < 1.0 or s["min_p"] > 0):
            out["temperature after the filters"] = _filtered_probs(pen, s, temperature_last=True)
        if s["top_k"] == 0:
            out["top_k=0 keeps nothing"] = None
    return out


def _penalized(logits, history, r):
    lg = logits.clone()
    if r != 1.0 and history:
        seen = torch.tensor(sorted(set(history)))
        lg[seen] = torch.where(lg[seen] > 0, lg[seen] / r, lg[seen] * r)
    return lg


def _filtered_probs(lg, s, crossing=True, p_first=False, min_p_absolute=False, temperature_last=False):
    """A one-row re-implementation with a switch per mistake (for the hints only)."""
    lg = lg.clone().double()
    t = s["temperature"]
    if t == 0:
        return torch.nn.functional.one_hot(lg.argmax(), lg.numel()).double()
    if not temperature_last:
        lg = lg / t
    v = lg.numel()

    def apply_min_p(x):
        if s["min_p"] <= 0:
            return x
        p = x.softmax(-1)
        threshold = s["min_p"] if min_p_absolute else s["min_p"] * p.max()
        return x.masked_fill(p < threshold, -math.inf)

    def apply_top_k(x):
        k = s["top_k"]
        if 0 < k < v:
            kth = x.sort(descending=True).values[k - 1]
            return x.masked_fill(x < kth, -math.inf)
        return x

    def apply_top_p(x):
        if s["top_p"] >= 1.0:
            return x
        sorted_x, order = x.sort(descending=True)
        p = sorted_x.softmax(-1)
        before = p.cumsum(-1) - p
        drop = before >= s["top_p"] if crossing else p.cumsum(-1) > s["top_p"]
        drop[0] = False
        return x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)

    lg = apply_min_p(lg)
    lg = apply_top_k(apply_top_p(lg)) if p_first else apply_top_p(apply_top_k(lg))
    if temperature_last:
        lg = lg / t
    return lg.softmax(-1)


_HINTS = {
    "divides negative logits too": "the repetition penalty divides a positive logit by r but MULTIPLIES a negative "
                                   "one (dividing a negative logit by r > 1 would make the token more likely)",
    "applied once per occurrence": "the repetition penalty applies once to every token that occurs in the history, "
                                   "however often it occurs (use set(history))",
    "the wrong way round": "positive logits are divided by r, negative ones multiplied by r (not the other way round)",
    "top_p drops the crossing token": "top_p keeps the token whose probability crosses top_p: keep a token while the "
                                      "mass of the tokens before it is below top_p",
    "top_p before top_k": "the order is min_p, top_k, then top_p on what top_k kept (renormalized)",
    "min_p absolute": "min_p is relative: drop tokens whose probability is below min_p times the most likely "
                      "token's probability, not below min_p",
    "temperature after the filters": "divide the logits by the temperature first: min_p and top_p act on the "
                                     "tempered distribution",
    "top_k=0 keeps nothing": "top_k = 0 (like -1) means off: keep every token",
}


def _compare(fn: Callable, logits: torch.Tensor, history: list[int], setting: dict, why: str = "") -> None:
    call = _case_call(logits, history, setting)
    before = logits.clone()
    top_k = setting.get("top_k", -1)
    crash_hint = ("top_k = -1 or 0 (or k >= V) means off: keep every token" if top_k <= 0 or top_k >= logits.numel()
                  else "temperature 0 is greedy: return the one-hot of the argmax before dividing by it"
                  if setting.get("temperature", 1.0) == 0 else "")
    got = _call(lambda lg, h: fn(lg, h, **setting), (logits, list(history)), call + (f" ({why})" if why else ""),
                crash_hint)
    if not torch.equal(before.nan_to_num(), logits.nan_to_num()):
        raise CheckFailed(f"{call} changed the logits it was given (in place): work on a copy, the engine still "
                          "needs the raw logits (logprobs are read from them)")
    want = reference_probs(before, history, **setting).double()
    got = _as_probs(got, want.numel(), call)
    same_support = torch.equal(got > 0, want > 0)
    if same_support and torch.allclose(got, want, atol=ATOL, rtol=0):
        return
    where = f" ({why})" if why else ""
    kept_got, kept_want = int((got > 0).sum()), int((want > 0).sum())
    summary = f"keeps {kept_got} tokens, expected {kept_want}" if not same_support else (
        f"probabilities differ by up to {float((got - want).abs().max()):.3g}")
    hint = ""
    if abs(float(got.sum()) - 1) > 1e-4:
        hint = f"the result sums to {float(got.sum()):.4g}: return probabilities (a softmax), not logits"
    elif setting.get("temperature", 1.0) == 0:
        hint = ("temperature = 0 is greedy: a one-hot distribution (1.0) on the argmax of the penalized logits "
                "(the first index on a tie, as torch.argmax)")
    else:
        for name, variant in _variants(before, history, setting).items():
            if variant is None and kept_got == 0:
                hint = _HINTS[name]
            elif variant is not None and torch.equal(got > 0, variant > 0) and torch.allclose(got, variant.double(), atol=1e-5):
                hint = _HINTS[name]
                break
        if not hint and kept_got < kept_want and kept_got == 0:
            hint = "the most likely token always stays"
        if not hint:
            hint = ("the order is: repetition penalty, temperature, min_p (relative to the top token), top_k (ties "
                    "with the k-th value stay), top_p (on what is left, renormalized), softmax")
    shown = ""
    if want.numel() <= 8:
        shown = f": got {[round(float(x), 4) for x in got]}, expected {[round(float(x), 4) for x in want]}"
    raise CheckFailed(f"{call}{where} {summary}{shown}: {hint}")


def _hand_cases() -> list[tuple[list[float], list[int], dict, str]]:
    lg = [2.0, 1.0, 0.5, 0.0, -1.0, -2.0]
    return [
        (lg, [], {}, "all settings off: the softmax of the logits"),
        (lg, [], {"temperature": 0.5}, "temperature 0.5 sharpens: logits / 0.5"),
        (lg, [], {"temperature": 2.0}, "temperature 2 flattens"),
        (lg, [], {"temperature": 0.0}, "temperature 0 is greedy: one-hot on the argmax"),
        (lg, [], {"top_k": 2}, "top_k 2 keeps tokens 0 and 1"),
        (lg, [], {"top_k": -1}, "top_k -1 is off"),
        (lg, [], {"top_k": 0}, "top_k 0 is off too"),
        (lg, [], {"top_k": 10}, "top_k larger than the vocabulary keeps everything"),
        ([1.0, 3.0, 3.0, 3.0, 0.0, 2.0], [], {"top_k": 2}, "ties with the k-th largest logit stay"),
        (lg, [], {"top_p": 0.9}, "top_p 0.9: the token that crosses 0.9 stays"),
        (lg, [], {"top_p": 0.01}, "a tiny top_p keeps only the most likely token"),
        (lg, [], {"top_p": 1.0}, "top_p 1 is off"),
        (lg, [], {"top_k": 3, "top_p": 0.8}, "top_p acts on what top_k kept, renormalized"),
        (lg, [], {"min_p": 0.2}, "min_p 0.2: keep tokens at least 0.2 x the top token's probability"),
        (lg, [], {"min_p": 1.0}, "min_p 1 keeps the most likely token only"),
        (lg, [], {"min_p": 0.3, "temperature": 2.0}, "min_p acts on the tempered distribution"),
        (lg, [0, 4], {"repetition_penalty": 2.0}, "penalty 2: logit 2.0 -> 1.0, logit -1.0 -> -2.0"),
        (lg, [0, 0, 0, 4], {"repetition_penalty": 2.0}, "a token repeated in the history is penalized once"),
        (lg, [3], {"repetition_penalty": 2.0}, "a zero logit stays zero"),
        ([1.0, 0.9, 0.0, -1.0, 0.5, 0.2], [0], {"repetition_penalty": 1.5, "temperature": 0.0},
         "greedy sees the penalty: token 0 falls below token 1"),
        ([2.0, -math.inf, 1.0, -math.inf, 0.0, 0.5], [], {"temperature": 0.7, "top_p": 0.95},
         "-inf logits (banned before the sampler) keep probability 0"),
        ([2.0, -math.inf, 1.0, 0.0, -math.inf, 0.5], [1, 0], {"repetition_penalty": 1.3, "min_p": 0.1},
         "a banned token in the history stays banned"),
    ]


def check_process_logits_cases(process_logits: Callable) -> None:
    """The contract's cases by hand (six tokens), each with its reason."""
    cases = _hand_cases()
    for logits, history, setting, why in cases:
        _compare(process_logits, torch.tensor(logits, dtype=torch.float32), history, setting, why)
    passed("process_logits on the stated cases", len(cases))


def random_setting(rng: random.Random, vocab: int) -> dict:
    setting = {}
    if rng.random() < 0.15:
        setting["temperature"] = 0.0
    elif rng.random() < 0.8:
        setting["temperature"] = rng.choice((0.3, 0.7, 1.0, 1.3, 2.0))
    if rng.random() < 0.5:
        setting["top_k"] = rng.choice((-1, 0, 1, 2, 5, 20, vocab, vocab + 3))
    if rng.random() < 0.6:
        setting["top_p"] = rng.choice((0.1, 0.5, 0.8, 0.9, 0.95, 1.0))
    if rng.random() < 0.4:
        setting["min_p"] = rng.choice((0.0, 0.01, 0.05, 0.2, 0.5))
    if rng.random() < 0.5:
        setting["repetition_penalty"] = rng.choice((1.0, 1.1, 1.3, 2.0, 0.8))
    return setting


def random_case(seed: int, index: int) -> tuple[torch.Tensor, list[int], dict]:
    rng = random.Random(seed * 100003 + index)
    vocab = rng.choice((7, 50, 300, 2048))
    g = torch.Generator().manual_seed(seed * 100003 + index)
    logits = torch.randn(vocab, generator=g) * rng.choice((0.5, 2.0, 5.0))
    history = [rng.randrange(vocab) for _ in range(rng.choice((0, 1, 5, 30)))]
    return logits, history, random_setting(rng, vocab)


def check_process_logits(process_logits: Callable, seed: int = 0, num_cases: int = 150) -> None:
    """Fresh random logits (7 to 2048 tokens) and random settings: your distribution equals the engine's
    processed_probs (the same tokens above 0, each probability within 1e-6)."""
    for index in range(num_cases):
        logits, history, setting = random_case(seed, index)
        _compare(process_logits, logits, history, setting, f"random case {index} of seed {seed}")
    passed(f"process_logits on random logits (seed {seed})", num_cases)


# =================================================================== 3. the learner's sampler in the engine
def print_engine_run(result: dict) -> None:
    for name in ("greedy", "sampled"):
        run = result[name]
        verdict = "✓ the same tokens as the engine's own sampler" if run["equal"] else "✗ not the engine's tokens"
        print(f"{name} ({describe(run['setting'])}): {verdict}")
        for mine in run["text"][:2]:
            print(f"  {mine[:90]!r}")
    print(f"your process_logits ran on {result['calls']} rows")


def check_engine_run(result: dict | None) -> None:
    """The engine with the learner's sampler: the same tokens as the engine's own, greedy and seeded-sampled."""
    if result is None:
        raise CheckFailed("engine_run is None: run the cell above (it needs process_logits)")
    if result["calls"] == 0:
        raise CheckFailed("the engine never called process_logits: pass sampler=LearnerSampler(process_logits)")
    for name in ("greedy", "sampled"):
        run = result[name]
        if run["equal"]:
            continue
        for i, (a, b) in enumerate(zip(run["tokens"], run["expected"])):
            if a != b:
                j = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise CheckFailed(f"{name} run ({describe(run['setting'])}), prompt {i}: your sampler's tokens part "
                                  f"from the engine's at output token {j} ({a[j:j + 3]} vs {b[j:j + 3]}): "
                                  + ("greedy takes the argmax of the penalized logits: check the repetition penalty"
                                     if name == "greedy" else "the distribution differs: run the two checks above"))
    passed("your sampler in the engine", 2)


CHI_VOCAB = 12        # the chi-square runs on the first token's 12 most likely candidates
CHI_ALPHA = 1e-3      # reject "follows the reference" below this p-value (seeded: a right sampler passes with margin)
CHI_SETTING = {"temperature": 1.3, "top_k": 10, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.2}


def chi_square_logits() -> tuple[torch.Tensor, list[int]]:
    """A fixed row of 12 logits (a real first token's top candidates, rounded) and a history that repeats two of them."""
    logits = torch.tensor([3.1, 3.1, 2.9, 1.8, 1.1, 0.6, 0.0, -0.3, -0.3, -0.9, -1.6, -2.4])
    return logits, [0, 3, 3]


def sampler_draws(sampler, num_draws: int = 3000, seed: int = 0, setting: dict | None = None) -> dict:
    """`num_draws` rows of the same logits in one SamplingBatch, each with its own seeded generator, through a Sampler
    (the learner's LearnerSampler): the counts of each token against the reference distribution."""
    setting = dict(CHI_SETTING if setting is None else setting)
    logits, history = chi_square_logits()
    params = SamplingParams(**setting)
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(num_draws)]
    batch = SamplingBatch([params] * num_draws, gens, [list(history)] * num_draws, [[] for _ in range(num_draws)])
    tokens = _call(sampler.sample, (logits.unsqueeze(0).repeat(num_draws, 1), batch),
                   f"LearnerSampler(process_logits).sample(logits [{num_draws}, {CHI_VOCAB}], batch) ({describe(setting)})")
    if not isinstance(tokens, (list, tuple)) or len(tokens) != num_draws:
        raise CheckFailed(f"the sampler returned {type(tokens).__name__} of {len(tokens) if hasattr(tokens, '__len__') else '?'} "
                          f"tokens for {num_draws} rows; one token id per row")
    counts = torch.zeros(CHI_VOCAB, dtype=torch.long)
    for t in tokens:
        if not 0 <= int(t) < CHI_VOCAB:
            raise CheckFailed(f"the sampler drew token {t}, outside the vocabulary of {CHI_VOCAB}")
        counts[int(t)] += 1
    want = reference_probs(logits, history, **setting)
    return {"counts": counts, "probs": want, "p_value": chi_square_p_value(counts, want), "setting": setting,
            "num_draws": num_draws}


def print_draws(draws: dict) -> None:
    n = draws["num_draws"]
    print(f"{n} seeded draws through your sampler ({describe(draws['setting'])}):")
    print("  token     " + "".join(f"{i:>7}" for i in range(CHI_VOCAB)))
    print("  yours     " + "".join(f"{c / n:>7.3f}" for c in draws["counts"].tolist()))
    print("  reference " + "".join(f"{p:>7.3f}" for p in draws["probs"].tolist()))
    ok = draws["p_value"] >= CHI_ALPHA
    print(f"  chi-square p-value {draws['p_value']:.3g}: " + ("✓ follows the reference" if ok else
                                                              "✗ not the reference distribution"))


def check_sampler_chi_square(sampler, num_draws: int = 3000, seed: int = 0, setting: dict | None = None) -> None:
    """The learner's sampler draws, many times with seeded generators, follow the engine's distribution."""
    draws = sampler_draws(sampler, num_draws, seed, setting)
    if draws["p_value"] < CHI_ALPHA:
        freq = [round(c / num_draws, 3) for c in draws["counts"].tolist()]
        raise CheckFailed(f"chi-square over {num_draws} seeded draws ({describe(draws['setting'])}): frequencies "
                          f"{freq} do not follow the reference {[round(p, 3) for p in draws['probs'].tolist()]} "
                          f"(p-value {draws['p_value']:.2g} < {CHI_ALPHA}): process_logits must return the distribution "
                          "the engine draws from")
    passed(f"chi-square of your sampler's draws ({num_draws} draws)", 1)


# =================================================================== 4. the sweep: diversity and repetition
class EntropyRecorder:
    """The engine's own sampler (minillm/seams.py's Sampler), recording the entropy (nats) of every row's processed
    distribution: what each sampled token was drawn from (0 for a greedy row)."""

    def __init__(self):
        self.entropies: list[float] = []
        self.reference = TorchSampler()

    def sample(self, logits, batch) -> list[int]:
        probs = processed_probs(logits, batch).double()
        logp = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
        self.entropies.extend((-(probs * logp).sum(-1)).tolist())
        return self.reference.sample(logits, batch)


def _ngrams(tokens: Sequence[int], n: int) -> list[tuple]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def reference_diversity_stats(run: dict) -> dict:
    """The reference of the learner's diversity_stats."""
    bigrams = [g for sample in run["samples"] for g in _ngrams(sample, 2)]
    repeats = total = 0
    for sample in run["samples"]:
        grams = _ngrams(sample, 3)
        total += len(grams)
        repeats += len(grams) - len(set(grams))
    entropies = run["entropies"]
    return {"distinct_2": len(set(bigrams)) / len(bigrams) if bigrams else 0.0,
            "repetition": repeats / total if total else 0.0,
            "mean_entropy": sum(entropies) / len(entropies) if entropies else 0.0}


STATS = ("distinct_2", "repetition", "mean_entropy")

# synthetic runs where each usual mistake gives another number
_SYNTHETIC_RUNS = [
    {"label": "two samples share bigrams", "samples": [[1, 2, 3, 1, 2], [1, 2, 9]], "entropies": [0.5, 1.5, 1.0]},
    {"label": "a loop", "samples": [[7, 8, 9, 7, 8, 9, 7, 8, 9]], "entropies": [0.1] * 9},
    {"label": "repeats across samples only", "samples": [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6]],
     "entropies": [2.0, 1.0]},
    {"label": "short samples", "samples": [[4], [], [5, 6]], "entropies": [0.7]},
    {"label": "no samples", "samples": [], "entropies": [0.3]},
]


def _stats_hint(key: str, got: float, run: dict) -> str:
    samples = run["samples"]
    if key == "distinct_2":
        per_sample = [len(set(_ngrams(s, 2))) / len(_ngrams(s, 2)) for s in samples if len(s) >= 2]
        joined = [t for s in samples for t in s]
        if per_sample and math.isclose(got, sum(per_sample) / len(per_sample), rel_tol=1e-9) :
            return "pool the bigrams of all samples first (a bigram two samples share counts once), then divide"
        unigrams = [t for s in samples for t in s]
        if unigrams and math.isclose(got, len(set(unigrams)) / len(unigrams), rel_tol=1e-9):
            return "distinct-2 counts bigrams (pairs of neighbouring tokens), not single tokens"
        glued = _ngrams(joined, 2)
        if glued and math.isclose(got, len(set(glued)) / len(glued), rel_tol=1e-9):
            return "a bigram never spans two samples: take each sample's bigrams on its own"
        return "distinct_2 = (distinct bigrams over all samples) / (all bigrams over all samples); 0.0 with none"
    if key == "repetition":
        pooled = [g for s in samples for g in _ngrams(s, 3)]
        if pooled and math.isclose(got, (len(pooled) - len(set(pooled))) / len(pooled), rel_tol=1e-9):
            return ("a repeat is a trigram seen earlier in the SAME sample: samples do not see each other (two samples "
                    "that agree are not repetitive)")
        return ("repetition = (trigrams that already occurred earlier in their own sample) / (all trigrams), pooled "
                "over the samples; 0.0 with none")
    entropies = run["entropies"]
    if entropies and math.isclose(got, sum(entropies) / len(entropies) / math.log(2), rel_tol=1e-9):
        return "the entropies are in nats already: do not convert to bits"
    return "mean_entropy = the mean of run['entropies'] (nats)"


def check_diversity_stats(diversity_stats: Callable, runs: Sequence[dict] | None) -> None:
    """The learner's statistics, recomputed from the raw samples of their own sweep, then on synthetic runs where
    each usual mistake gives another number."""
    if not runs:
        raise CheckFailed("sweep is None or empty: run the sweep cell above")
    cases = list(runs) + _SYNTHETIC_RUNS
    for run in cases:
        call = f"diversity_stats(run {run['label']!r})"
        copy = {**run, "samples": [list(s) for s in run["samples"]], "entropies": list(run["entropies"])}
        got = _call(diversity_stats, (copy,), call)
        if not isinstance(got, dict) or set(STATS) - set(got):
            raise CheckFailed(f"{call} returned {got!r}; expected a dict with the keys {list(STATS)}")
        want = reference_diversity_stats(run)
        for key in STATS:
            value = got[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
                raise CheckFailed(f"{call}[{key!r}] is {value!r}; expected a number, {want[key]:.4g}")
            value = float(value)
            if not math.isclose(value, want[key], rel_tol=1e-6, abs_tol=1e-12):
                shown = "" if len(run["samples"]) > 4 else f" (samples {run['samples']})"
                raise CheckFailed(f"{call}[{key!r}] = {value:.4g}, expected {want[key]:.4g}{shown}: "
                                  + _stats_hint(key, value, run))
    passed("diversity_stats", len(cases))


def sweep_rows(runs: Sequence[dict], diversity_stats: Callable) -> list[dict]:
    """One row per sweep run: its settings and the learner's statistics."""
    rows = []
    for run in runs:
        stats = _call(diversity_stats, (run,), f"diversity_stats(run {run['label']!r})")
        rows.append({"label": run["label"], **run["setting"], **{k: float(stats[k]) for k in STATS},
                     "texts": run["texts"]})
    return rows


def print_sweep(rows: Sequence[dict], device: str) -> None:
    print(f"measured on {device}; distinct-2 and repetition over each setting's samples, entropy in nats per token")
    print(f"{'setting':44}{'distinct-2':>11}{'repetition':>11}{'entropy':>9}")
    for r in rows:
        print(f"{r['label']:44}{r['distinct_2']:>11.3f}{r['repetition']:>11.3f}{r['mean_entropy']:>9.2f}")


def _grid(rows):
    return [r for r in rows if r.get("temperature", 0) > 0 and r.get("repetition_penalty", 1.0) == 1.0]


def diversity_figure(rows: Sequence[dict], device: str):
    """distinct-2 (solid) and repetition (dotted) against temperature, one colour per top_p."""
    fig = new_figure("Diversity and repetition vs temperature and top_p", "temperature", "fraction", device=device)
    grid = _grid(rows)
    colors = ["royalblue", "firebrick", "seagreen", "darkorange", "purple"]
    for i, top_p in enumerate(sorted({r.get("top_p", 1.0) for r in grid}, reverse=True)):
        mine = sorted((r for r in grid if r.get("top_p", 1.0) == top_p), key=lambda r: r["temperature"])
        color = colors[i % len(colors)]
        fig.add_scatter(x=[r["temperature"] for r in mine], y=[r["distinct_2"] for r in mine], mode="lines+markers",
                        name=f"distinct-2, top_p {top_p}", line=dict(color=color))
        fig.add_scatter(x=[r["temperature"] for r in mine], y=[r["repetition"] for r in mine], mode="lines+markers",
                        name=f"repetition, top_p {top_p}", line=dict(color=color, dash="dot"))
    return fig


def entropy_figure(rows: Sequence[dict], device: str):
    """Mean entropy per token against temperature, one line per top_p."""
    fig = new_figure("Entropy of the distribution each token is drawn from", "temperature", "nats per token",
                     device=device)
    grid = _grid(rows)
    for top_p in sorted({r.get("top_p", 1.0) for r in grid}, reverse=True):
        mine = sorted((r for r in grid if r.get("top_p", 1.0) == top_p), key=lambda r: r["temperature"])
        fig.add_scatter(x=[r["temperature"] for r in mine], y=[r["mean_entropy"] for r in mine],
                        mode="lines+markers", name=f"top_p {top_p}")
    return fig


class DecodingExplorer:
    """Two sliders (temperature, top_p) over the measured grid: the setting's statistics and two of its samples, and
    a star on the diversity figure."""

    def __init__(self, rows: Sequence[dict], device: str):
        import ipywidgets as widgets

        from .common import control_panel

        self.rows = _grid(rows)
        if not self.rows:
            raise ValueError("the sweep has no sampled setting (temperature > 0, no repetition penalty)")
        temps = sorted({r["temperature"] for r in self.rows})
        tops = sorted({r.get("top_p", 1.0) for r in self.rows})
        self.temperature = widgets.SelectionSlider(options=temps, value=temps[len(temps) // 2], description="temperature",
                                                   continuous_update=False, style={"description_width": "initial"})
        self.top_p = widgets.SelectionSlider(options=tops, value=tops[-1], description="top_p",
                                             continuous_update=False, style={"description_width": "initial"})
        base = diversity_figure(rows, device)
        base.add_scatter(x=[], y=[], mode="markers", name="chosen", marker=dict(size=16, symbol="star", color="black"))
        control_panel(self, [self.temperature, self.top_p], base, row=True)

    def update(self) -> None:
        import html

        t, p = self.temperature.value, self.top_p.value
        row = next((r for r in self.rows if r["temperature"] == t and r.get("top_p", 1.0) == p), None)
        self.chosen = row
        star = self.figure.data[-1]
        if row is None:
            star.x, star.y = [], []
            self.label.value = f"temperature {t}, top_p {p}: <b>not measured</b> (the sweep skipped it)"
            return
        star.x, star.y = [t], [row["distinct_2"]]
        samples = "".join(f"<li><code>{html.escape(text[:160])}</code></li>" for text in row["texts"][:2])
        self.label.value = (f"temperature {t}, top_p {p}: distinct-2 <b>{row['distinct_2']:.3f}</b>, repetition "
                            f"<b>{row['repetition']:.3f}</b>, entropy <b>{row['mean_entropy']:.2f}</b> nats/token"
                            f"<ul>{samples}</ul>")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def row_for(rows: Sequence[dict], **setting) -> dict:
    """The sweep row whose settings match (missing keys take the SamplingParams defaults)."""
    defaults = {"temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0}
    for r in rows:
        if all(r.get(k, defaults.get(k)) == v for k, v in setting.items()):
            return r
    raise KeyError(f"no sweep row with {setting}")


# =================================================================== 5. stop and max_tokens as cost
def print_limits(rows: Sequence[dict], device: str) -> None:
    print(f"one request each, greedy, on {device} (at {rows[0]['hourly_usd']} USD/h); the API column prices output "
          f"tokens at {API_USD_PER_MTOK} USD per million")
    print(f"{'limits':34}{'tokens':>7}{'finish':>8}{'wall':>10}{'USD here':>11}{'USD at API':>12}")
    for r in rows:
        print(f"{r['label']:34}{r['tokens']:>7}{r['finish_reason']:>8}{format_seconds(r['wall_s']):>10}"
              f"{r['usd']:>11.2e}{r['api_usd']:>12.2e}")
    for r in rows:
        print(f"  {r['label']}: {r['text'][:100]!r}")


def check_answer_worst_case_usd(value) -> None:
    n, max_tokens, price = WORST_CASE["n"], WORST_CASE["max_tokens"], WORST_CASE["usd_per_mtok"]
    want = n * max_tokens * price / 1e6
    case = f"answer_worst_case_usd (n = {n}, max_tokens = {max_tokens}, {price} USD per million output tokens)"
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"{case} is {value!r}; set it to a number of dollars (a float)")
    if math.isclose(value, want, rel_tol=1e-3):
        passed("answer_worst_case_usd", 1)
        return
    if math.isclose(value, max_tokens * price / 1e6, rel_tol=1e-3):
        hint = "max_tokens bounds each of the n completions: n times as many output tokens at most"
    elif math.isclose(value, n * max_tokens * price, rel_tol=1e-3) or math.isclose(value, max_tokens * price, rel_tol=1e-3):
        hint = "the price is per MILLION tokens: divide by 1e6"
    elif math.isclose(value, n * max_tokens * price / 1e3, rel_tol=1e-3):
        hint = "per million is 1e6 tokens, not 1e3"
    else:
        hint = "output tokens at most = n x max_tokens; dollars = tokens x price / 1e6"
    raise CheckFailed(f"{case} = {value!r} is not the bound: {hint}")


# =================================================================== 6. n > 1 on shared blocks
def print_parallel(result: dict) -> None:
    n = result["n"]
    shared, separate = result["shared"], result["separate"]
    print(f"a {result['prompt_tokens']}-token prompt, {n} continuations of {result['max_tokens']} tokens each, "
          f"on {result['device']}")
    print(f"  n = {n} in one request : peak KV {shared['peak_kv_bytes'] / 2**20:7.2f} MiB "
          f"(sharing saved {shared['peak_kv_shared_bytes'] / 2**20:.2f} MiB), {format_seconds(shared['wall_s'])}")
    print(f"  {n} separate requests  : peak KV {separate['peak_kv_bytes'] / 2**20:7.2f} MiB, "
          f"{format_seconds(separate['wall_s'])}")
    print(f"  ratio {shared['peak_kv_bytes'] / separate['peak_kv_bytes']:.2f}; the same {n} texts: "
          + ("✓ yes" if result["same_texts"] else "✗ no"))
    for text in shared["texts"][:2]:
        print(f"  {text[:90]!r}")


def kv_ratio_model(prompt_tokens: int, output_tokens: int, n: int, block_size: int | None = None) -> float:
    """Shared over separate KV when only the prompt is shared: (P + n·O) / (n·(P + O)); with block_size, each
    continuation after the first also holds a copy of the prompt's partly filled last block (P mod block_size
    tokens)."""
    copies = (n - 1) * (prompt_tokens % block_size) if block_size else 0
    return (prompt_tokens + copies + n * output_tokens) / (n * (prompt_tokens + output_tokens))


def print_kv_models(result: dict) -> None:
    """The measured ratio beside the two models (prompt shared; prompt shared but its last partial block copied)."""
    p, o, n, b = result["prompt_tokens"], result["max_tokens"], result["n"], result["block_size"]
    measured = result["shared"]["peak_kv_bytes"] / result["separate"]["peak_kv_bytes"]
    print(f"measured {measured:.3f}; model (P + n·O) / (n·(P + O)) = {kv_ratio_model(p, o, n):.3f}; with the "
          f"{n - 1} copies of the last block's {p % b} tokens: {kv_ratio_model(p, o, n, b):.3f}")


# =================================================================== 7. structured output
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "minLength": 1, "maxLength": 20}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def reference_valid_person(text: str) -> bool:
    """True iff the whole text is one JSON object with exactly name (1-20 characters), age (an integer 0-120, not a
    bool or a float) and city (1-20 characters)."""
    try:
        value = json.loads(text)
    except (ValueError, TypeError):
        return False
    if not isinstance(value, dict) or set(value) != {"name", "age", "city"}:
        return False
    age = value["age"]
    if isinstance(age, bool) or not isinstance(age, int) or not 0 <= age <= 120:
        return False
    return all(isinstance(value[key], str) and 1 <= len(value[key]) <= 20 for key in ("name", "city"))


VALID_CASES = [
    ('{"name": "Ada", "age": 36, "city": "London"}', "a valid person"),
    ('  {"city": "Oslo", "age": 0, "name": "Bo"}\n', "keys in any order, whitespace around, age 0"),
    ('{"name": "Ada", "age": 120, "city": "London"}', "age 120 is the maximum, still valid"),
    ('```json\n{"name": "Ada", "age": 36, "city": "London"}\n```', "a Markdown fence around it is not JSON"),
    ('{"name": "Ada", "age": 36, "city": "London"} and more', "text after the object"),
    ('{"name": "Ada", "age": 36}', "a required key is missing"),
    ('{"name": "Ada", "age": 36, "city": "London", "job": "poet"}', "an extra key (additionalProperties: false)"),
    ('{"name": "Ada", "age": "36", "city": "London"}', "age as a string"),
    ('{"name": "Ada", "age": true, "city": "London"}', "true is a bool, not an integer (bool is an int in Python)"),
    ('{"name": "Ada", "age": 36.5, "city": "London"}', "a float age"),
    ('{"name": "Ada", "age": 36.0, "city": "London"}', "36.0 is a float here, not an integer"),
    ('{"name": "Ada", "age": -1, "city": "London"}', "age below 0"),
    ('{"name": "Ada", "age": 121, "city": "London"}', "age above 120"),
    ('{"name": "", "age": 36, "city": "London"}', "an empty name"),
    ('{"name": "Ada Augusta Byron King Lovelace", "age": 36, "city": "London"}', "a name longer than 20 characters"),
    ('{"name": "Ada", "age": 36, "city": 7}', "a city that is not a string"),
    ('{"name": "Ada", "age": 36, "city": ""}', "an empty city"),
    ('{"name": "Ada", "age": 36, "city": "Llanfairpwllgwyngyll on Anglesey"}', "a city longer than 20 characters"),
    ('[{"name": "Ada", "age": 36, "city": "London"}]', "a list, not an object"),
    ('{"name": "Ada", "age": 36, "city": "Lon', "cut off in the middle (max_tokens reached)"),
    ("", "an empty answer"),
    ("null", "JSON null"),
]


def check_valid_person(valid_person: Callable) -> None:
    for text, why in VALID_CASES:
        call = f"valid_person({text!r})"
        got = _call(valid_person, (text,), f"{call} ({why})",
                    "catch json.JSONDecodeError (a ValueError): text that is not JSON is not a valid person")
        want = reference_valid_person(text)
        if not isinstance(got, bool):
            raise CheckFailed(f"{call} returned {got!r} ({type(got).__name__}); return True or False")
        if got != want:
            raise CheckFailed(f"{call} returned {got}, expected {want}: {why}")
    passed("valid_person", len(VALID_CASES))


def print_structured(result: dict, valid: Callable | None = None) -> None:
    valid = valid or reference_valid_person
    print(f"{result['num_prompts']} prompts, greedy, up to {result['max_tokens']} tokens, on {result['device']}")
    for name in ("free", "constrained"):
        run = result[name]
        ok = [bool(valid(t)) for t in run["texts"]]
        print(f"  {name:12}: {sum(ok)} of {len(ok)} valid, {run['tokens']} tokens in {run['steps']} steps, "
              f"{format_seconds(run['step_s'])} per step")
        print(f"      {run['texts'][0][:100]!r}")
    c = result["constrained"]
    print(f"  the mask: {format_seconds(c['mask_s'] / max(c['mask_steps'], 1))} per step over {c['mask_steps']} steps "
          f"({c['mask_s'] / max(c['steps_s'], 1e-9):.1%} of the constrained run's step time)")
    print(f"  step time constrained / free: {c['step_s'] / result['free']['step_s']:.2f}x")


__all__ = ["reference_probs", "LogitsRecorder", "first_token_logits", "print_distribution", "kept_tokens", "describe",
           "check_process_logits_cases", "check_process_logits", "chat_prompts", "print_engine_run",
           "check_engine_run", "sampler_draws", "print_draws", "check_sampler_chi_square", "EntropyRecorder",
           "check_diversity_stats", "sweep_rows", "print_sweep", "diversity_figure", "entropy_figure",
           "DecodingExplorer", "row_for", "print_limits", "check_answer_worst_case_usd", "print_parallel",
           "kv_ratio_model", "print_kv_models", "PERSON_SCHEMA", "check_valid_person", "print_structured", "echo_prediction",
           "CheckFailed", "API_USD_PER_MTOK", "WORST_CASE"]


# =================================================================== 3b. the fused mask kernel (Triton)
# The learner's kernel: one program per row of [B, V] logits (already divided by the temperature) applies min-p,
# top-k and top-p in one pass, without sorting: each threshold is found by bisection on the bits of a
# non-negative float (ordered like the floats themselves). The torch spec below is what it must equal.
def mask_reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[B, V] logits and [B] settings -> the same logits with every dropped token at -inf, one row at a time:
    with e = exp(x - max(x)) (1 for the most likely token), min-p keeps e >= min_p; top-k keeps e >= the k-th
    largest e of what min-p kept (ties stay; k <= 0 or k >= V: off); top-p, on p = what is left renormalized,
    keeps p >= the smallest p whose mass of strictly more likely tokens is below top_p (top_p >= 1: off).
    A -inf logit stays -inf; the most likely token always stays."""
    out = torch.empty_like(logits)
    vocab = logits.shape[-1]
    for row in range(logits.shape[0]):
        x = logits[row]
        e = torch.exp(x - x.max())
        keep = x > float("-inf")
        if float(min_p[row]) > 0:
            keep &= e >= float(min_p[row])
        k = int(top_k[row])
        if 0 < k < vocab:
            keep &= e >= e.masked_fill(~keep, -1.0).topk(k).values[-1]
        if float(top_p[row]) < 1.0:
            p = torch.where(keep, e, torch.zeros_like(e))
            p = p / p.sum()
            sorted_p = p.sort(descending=True).values
            before = sorted_p.cumsum(0) - sorted_p
            keep &= p >= sorted_p[before < float(top_p[row])].min()
        out[row] = x.masked_fill(~keep, float("-inf"))
    return out


def make_mask_inputs(rows: Sequence[dict], vocab: int, seed: int = 0, device: str = "cpu") -> tuple:
    """Fresh random logits [len(rows), vocab] (standard normal x 3) and the settings' tensors (top_k int32, top_p
    and min_p fp32); a row's "ties" puts its first 4 logits at its maximum, "banned" sets every 5th logit to -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), vocab, generator=gen) * 3.0
    for i, row in enumerate(rows):
        if row.get("ties"):
            logits[i, :4] = logits[i].max()
        if row.get("banned"):
            logits[i, 1::5] = float("-inf")
    top_k = torch.tensor([int(r.get("top_k", 0)) for r in rows], dtype=torch.int32)
    top_p = torch.tensor([float(r.get("top_p", 1.0)) for r in rows], dtype=torch.float32)
    min_p = torch.tensor([float(r.get("min_p", 0.0)) for r in rows], dtype=torch.float32)
    return tuple(t.to(device) for t in (logits, top_k, top_p, min_p))


# the checks' cases: (vocab, rows); each row a setting. Small vocabularies, not powers of 2: the tail is masked.
MASK_CASES = [
    (13, [{}, {"top_k": 1}, {"top_k": 3}, {"top_k": 13}, {"top_k": -1}, {"top_k": 2, "ties": True}]),
    (50, [{"min_p": 0.1}, {"min_p": 1.0}, {"top_p": 0.5}, {"top_p": 0.9, "banned": True}, {"top_p": 1e-6},
          {"top_k": 5, "banned": True}]),
    (300, [{"top_k": 20, "top_p": 0.8, "min_p": 0.02}, {"top_k": 400, "top_p": 0.95}, {"top_p": 0.7, "min_p": 0.3},
           {"top_k": 7, "ties": True, "top_p": 0.6}, {}, {"top_k": 1, "top_p": 0.1, "min_p": 0.9}]),
]
HIDDEN_MASK_CASES = [
    (77, [{"top_k": 76}, {"top_k": 77}, {"top_p": 0.999}, {"min_p": 0.5, "banned": True}]),
    (1000, [{"top_k": 50, "top_p": 0.9, "min_p": 0.05}, {"top_k": 3, "ties": True}, {"top_p": 0.3, "banned": True}]),
]


def _describe_mask_row(row: dict) -> str:
    parts = [f"{k}={row[k]}" for k in ("top_k", "top_p", "min_p") if k in row]
    parts += [k for k in ("ties", "banned") if row.get(k)]
    return ", ".join(parts) or "every filter off"


def _mask_hint(got_keep: torch.Tensor, want_keep: torch.Tensor, logits: torch.Tensor, row: dict) -> str:
    vocab = logits.shape[-1]
    n_got, n_want = int(got_keep.sum()), int(want_keep.sum())
    if n_got == 0:
        return "the row keeps no token: the most likely token always stays"
    if row.get("banned") and bool((got_keep & logits.isneginf()).any()):
        return "a -inf logit came out kept: a banned token stays banned"
    if n_got == vocab and n_want < vocab:
        return "every token kept: a filter that is on was never applied"
    if n_got == n_want - 1 and bool((got_keep <= want_keep).all()):
        missing = int((want_keep & ~got_keep).nonzero()[0])
        smallest = int(logits.masked_fill(~want_keep, float("inf")).argmin())
        if float(logits[missing]) == float(logits[smallest]):
            if "top_p" in row and float(row["top_p"]) < 1.0:
                return ("top-p dropped the token that crosses top_p: it stays (the mass of the tokens *strictly more "
                        "likely* is below top_p)")
            return ("the least likely kept token was dropped: off by one at the k-th largest (keep e >= the k-th; "
                    "top_k off keeps every token)")
    if row.get("ties") and 0 < row.get("top_k", 0) < vocab:
        return "ties with the k-th largest stay (a threshold, not a count)"
    return ""


def check_mask_kernel(fused_mask: Callable, cases=MASK_CASES, seed: int = 0, device: str | None = None) -> None:
    """Your launcher (and kernel) on fresh random logits per case against mask_reference: the same tokens kept,
    each kept logit unchanged, every dropped one -inf, the output NaN-free (the launcher fills it with NaN)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    for index, (vocab, rows) in enumerate(cases):
        logits, top_k, top_p, min_p = make_mask_inputs(rows, vocab, seed * 1000 + index, device)
        call = f"fused_mask(logits [{len(rows)}, {vocab}], top_k, top_p, min_p) (case {index}, seed {seed})"
        got = _call(fused_mask, (logits.clone(), top_k, top_p, min_p), call)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(logits.shape):
            raise CheckFailed(f"{call} returned {getattr(got, 'shape', type(got).__name__)}; expected a tensor of "
                              f"shape {tuple(logits.shape)}")
        got = got.float().cpu()
        want = mask_reference(logits.cpu(), top_k.cpu(), top_p.cpu(), min_p.cpu())
        x = logits.cpu()
        for r, row in enumerate(rows):
            if bool(got[r].isnan().any()):
                col = int(got[r].isnan().nonzero()[0])
                raise CheckFailed(f"{call}, row {r} ({_describe_mask_row(row)}): NaN at column {col} of {vocab}: "
                                  "your kernel never stored it (program `row` stores row `row`: every column < V)")
        for r, row in enumerate(rows):
            got_keep, want_keep = got[r] > float("-inf"), want[r] > float("-inf")
            if not torch.equal(got_keep, want_keep):
                hint = _mask_hint(got_keep, want_keep, x[r], row)
                raise CheckFailed(f"{call}, row {r} ({_describe_mask_row(row)}): you keep {int(got_keep.sum())} tokens, "
                                  f"the reference {int(want_keep.sum())} (first difference at column "
                                  f"{int((got_keep != want_keep).nonzero()[0])})" + (f": {hint}" if hint else ""))
            if not torch.equal(got[r][got_keep], x[r][got_keep]):
                raise CheckFailed(f"{call}, row {r} ({_describe_mask_row(row)}): a kept logit changed; the kernel "
                                  "copies kept logits as they are (the temperature is already applied) and writes -inf "
                                  "for dropped ones")
    passed(f"your fused mask kernel (seed {seed})", sum(len(rows) for _, rows in cases))


class MaskKernelSampler:
    """The Sampler seam (minillm/seams.py) with the learner's fused mask: the engine's own steps 1-4 (biases, bans,
    penalties, greedy argmax), then each sampled row divided by its temperature, the whole batch masked by one launch
    of ``fused_mask``, the softmax, and one draw per row with the row's own generator (as the engine draws)."""

    def __init__(self, fused_mask: Callable):
        self.fused_mask = fused_mask
        self.launches = 0
        self.rows = 0
        self.kernel_s = 0.0

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
        import time

        from ..layers.sampler import apply_penalties

        logits = apply_penalties(logits, batch)
        out = logits.argmax(dim=-1).tolist()
        sampled = [i for i, p in enumerate(batch.params) if p.temperature != 0.0]
        if not sampled:
            return out
        params = [batch.params[i] for i in sampled]
        dev = logits.device
        scaled = (logits[sampled] / torch.tensor([p.temperature for p in params], device=dev,
                                                 dtype=logits.dtype).unsqueeze(1)).contiguous()
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int32, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        start = time.perf_counter()
        masked = self.fused_mask(scaled, top_k, top_p, min_p)
        self.kernel_s += time.perf_counter() - start
        self.launches += 1
        self.rows += len(sampled)
        probs = masked.float().softmax(-1)
        for j, row in enumerate(sampled):
            out[row] = int(torch.multinomial(probs[j], 1, generator=batch.generators[row]).item())
        return out


def print_mask_run(result: dict) -> None:
    """The engine on your mask kernel against its own sampler: the same seeded tokens."""
    from . import common

    common.print_kernel_run(result, [("the engine's own sampler", result["expected"], "")], result["launches"],
                            f"your kernel, one launch per decode step ({result['rows']} rows of {result['vocab']} logits)")


def check_mask_run(result: dict | None) -> None:
    """The engine with your kernel in its sampler: the same seeded tokens as its own sampler."""
    if result is None:
        raise CheckFailed("mask_run is None: run the cell above (it needs your kernel)")
    if result["launches"] == 0:
        raise CheckFailed("the engine never launched your kernel: pass sampler=lab09.MaskKernelSampler(fused_mask)")
    if not result["equal"]:
        for i, (a, b) in enumerate(zip(result["tokens"], result["expected"])):
            if a != b:
                j = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise CheckFailed(f"prompt {i}: your kernel's tokens part from the engine's at output token {j} "
                                  f"({a[j:j + 3]} vs {b[j:j + 3]}): the mask differs; run check_mask_kernel")
    passed("your kernel in the engine's sampler", len(result["tokens"]))


def time_mask_kernel(fused_mask: Callable, rows: int = 64, vocab: int = 49152) -> dict:
    """On a GPU: your fused mask against the engine's torch path (filter_batch: a sort of every row) on
    ``rows`` rows of ``vocab`` logits, every filter on."""
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    from ..layers.sampler import filter_batch
    from .common import gpu_seconds

    setting = {"top_k": 50, "top_p": 0.9, "min_p": 0.05}
    logits, top_k, top_p, min_p = make_mask_inputs([setting] * rows, vocab, 0, "cuda")
    ones = torch.ones(rows, device="cuda")
    yours_s = gpu_seconds(lambda: fused_mask(logits, top_k, top_p, min_p))
    engine_s = gpu_seconds(lambda: filter_batch(logits, ones, top_k.long(), top_p, min_p))
    return {"device": torch.cuda.get_device_name(), "rows": rows, "vocab": vocab, "yours_s": yours_s,
            "engine_s": engine_s}


def print_mask_timing(result: dict) -> None:
    from .common import print_no_gpu_timing

    if result["device"] == "cpu":
        print_no_gpu_timing("against the engine's torch path (a sort of every row)")
        return
    print(f"{result['rows']} rows x {result['vocab']} logits, top_k 50 + top_p 0.9 + min_p 0.05 — {result['device']}")
    print(f"  yours (one pass per bisection step, no sort): {format_seconds(result['yours_s'])}")
    print(f"  the engine's torch path (sort, cumsum, scatter): {format_seconds(result['engine_s'])} "
          f"-> yours is {result['engine_s'] / result['yours_s']:.2f}x its speed")


# =================================================================== measure: what sampling costs per request
# The course's reference run of the notebook's measure_sampling (full mode: MEASURE_TOKENS = 32, warmup 1, repeats 5,
# the story prompt, greedy vs temperature 0.9 + top_k 40 + top_p 0.9 + min_p 0.05), recorded on the machine named
# here (shared with other jobs at the time: the absolute times are slow, the ratio is the number to compare) with
#   MINILLM_QUICK=0 python: the notebook's cells "measure_sampling" and "cell-sampling-run" on LLM() (default model)
# -> greedy median 13.2 s (10.9 - 14.8), filtered median 14.2 s (13.7 - 14.3) per request of 32 tokens.
REFERENCE_SAMPLING = {"greedy_s": 13.23, "filtered_s": 14.18, "ratio": 1.07, "tokens": 32,
                      "hardware": "2-core AMD EPYC (AVX2)"}
MEASURE_NAMES = ("greedy", "filtered")


class FakeSamplingEngine:
    """What the measurement check hands your harness instead of the engine's requests: ``runs(...)`` gives
    {"greedy": f, "filtered": f}, each ``f()`` one request that moves the FakeClock by the setting's next scripted
    cost (and returns nothing useful)."""

    def __init__(self, clock, costs: dict):
        self.clock = clock
        self.costs = {name: list(c) for name, c in costs.items()}
        self.calls = {name: 0 for name in costs}

    def request(self, name: str) -> None:
        i = self.calls[name]
        if i >= len(self.costs[name]):
            raise CheckFailed(f"the {name} request was made {i + 1} times: warmup + repeats = {len(self.costs[name])}")
        self.calls[name] += 1
        self.clock.advance(self.costs[name][i])

    def runs(self) -> dict:
        def one(name):
            def run():
                return self.request(name)
            run.__name__ = f"{name}_request"
            return run
        return {name: one(name) for name in self.costs}


def check_measure_sampling(measure_sampling: Callable, warmup: int = 2, repeats: int = 5, seed: int = 0) -> None:
    """Your harness on fake requests and a FakeClock: each setting's warm-up calls dropped, the median of the timed
    ones reported with min and max, the ratio filtered / greedy. Real times are never compared."""
    from .common import FakeClock, scripted_costs, timing_mistake, timing_summary

    base = {"greedy": 0.5, "filtered": 0.65}
    costs = {name: scripted_costs(base[name], warmup, repeats, seed + i) for i, name in enumerate(MEASURE_NAMES)}
    clock = FakeClock()
    engine = FakeSamplingEngine(clock, costs)
    call = f"measure_sampling(fake requests, clock=FakeClock(), warmup={warmup}, repeats={repeats})"
    got = _call(lambda: measure_sampling(engine.runs(), clock=clock, warmup=warmup, repeats=repeats), (), call)
    if clock.reads == 0:
        raise CheckFailed(f"{call}: the FakeClock was never read: time with the `clock` argument, not "
                          "time.perf_counter() directly")
    for name in MEASURE_NAMES:
        if engine.calls[name] != warmup + repeats:
            raise CheckFailed(f"{call}: the {name} request ran {engine.calls[name]} times; warmup + repeats = "
                              f"{warmup + repeats} (warm up, then time each repeat)")
    if not isinstance(got, dict) or any(name not in got for name in (*MEASURE_NAMES, "ratio")):
        raise CheckFailed(f"{call} returned {got!r:.120}; expected a dict with 'greedy', 'filtered' (each "
                          "{'median', 'min', 'max', 'n'}) and 'ratio'")
    for name in MEASURE_NAMES:
        want = timing_summary(costs[name][warmup:])
        row = got[name]
        if not isinstance(row, dict) or any(k not in row for k in ("median", "min", "max", "n")):
            raise CheckFailed(f"{call}[{name!r}] = {row!r:.100}: a dict with median, min, max and n")
        if not math.isclose(float(row["median"]), want["median"], rel_tol=1e-6):
            why = timing_mistake(float(row["median"]), costs[name], warmup)
            raise CheckFailed(f"{call}[{name!r}]['median'] = {float(row['median']):.4g}, expected "
                              f"{want['median']:.4g}" + (f": that is {why}" if why else ""))
        for key in ("min", "max"):
            if not math.isclose(float(row[key]), want[key], rel_tol=1e-6):
                raise CheckFailed(f"{call}[{name!r}][{key!r}] = {float(row[key]):.4g}, expected {want[key]:.4g}: the "
                                  f"spread is the {key} of the timed calls (warm-up dropped)")
        if int(row["n"]) != repeats:
            raise CheckFailed(f"{call}[{name!r}]['n'] = {row['n']}: the number of timed calls, {repeats}")
    ratio = timing_summary(costs["filtered"][warmup:])["median"] / timing_summary(costs["greedy"][warmup:])["median"]
    if not math.isclose(float(got["ratio"]), ratio, rel_tol=1e-6):
        hint = ("inverted: filtered over greedy" if math.isclose(float(got["ratio"]), 1 / ratio, rel_tol=1e-6)
                else "the filtered median over the greedy median")
        raise CheckFailed(f"{call}['ratio'] = {float(got['ratio']):.4g}, expected {ratio:.4g}: {hint}")
    passed("measure_sampling on scripted requests", 2 * repeats + 1)


def print_sampling(result: dict, tokens: int) -> None:
    """Your measurement beside the course's reference run, per request and per token."""
    from .common import print_beside_reference

    for name in MEASURE_NAMES:
        row = result[name]
        print(f"{name:>9}: median {format_seconds(row['median'])} per request of {tokens} tokens "
              f"({format_seconds(row['median'] / tokens)} per token), spread {format_seconds(row['min'])} - "
              f"{format_seconds(row['max'])} over {row['n']} runs")
    print_beside_reference("filtered over greedy, per request", result["ratio"], REFERENCE_SAMPLING["ratio"],
                           REFERENCE_SAMPLING["hardware"], "x")


def sampling_figure(result: dict, tokens: int, device: str):
    """Per-token time of each setting: median bar, min-max whiskers, the reference beside it."""
    import plotly.graph_objects as go

    fig = new_figure("Sampling settings: time per output token", "setting", "ms per token", device=device)
    names = list(MEASURE_NAMES)
    med = [result[n]["median"] / tokens * 1e3 for n in names]
    fig.add_trace(go.Bar(x=names, y=med, name="yours (median)",
                         error_y={"type": "data", "symmetric": False,
                                  "array": [result[n]["max"] / tokens * 1e3 - m for n, m in zip(names, med)],
                                  "arrayminus": [m - result[n]["min"] / tokens * 1e3 for n, m in zip(names, med)]}))
    ref = [REFERENCE_SAMPLING[f"{n}_s"] / REFERENCE_SAMPLING["tokens"] * 1e3 for n in names]
    fig.add_trace(go.Bar(x=names, y=ref, name=f"reference ({REFERENCE_SAMPLING['hardware']})"))
    return fig


# =================================================================== 9. explain: the learner's own numbers
def print_your_numbers(first=None, sweep_table=None, limits=None, parallel=None, sampling=None, structured=None,
                       device: str = "") -> None:
    """The quantities the explain questions name, from this notebook's runs (a section that did not run says so)."""
    print(f"your numbers ({device}):")
    if first is not None:
        print(f"  Q1  first token: top_p 0.9 keeps {kept_tokens(first, top_p=0.9)} tokens, top_k 40 keeps "
              f"{kept_tokens(first, top_k=40)}, min_p 0.1 keeps {kept_tokens(first, min_p=0.1)}")
    if sweep_table:
        for row in sweep_table:
            print(f"  Q1/Q2 {row['label']:34} distinct-2 {row['distinct_2']:.3f}  repetition {row['repetition']:.3f}  "
                  f"mean entropy {row['mean_entropy']:.2f} nats")
    else:
        print("  Q1/Q2 the sweep table: finish exercise 4")
    if limits:
        for row in limits:
            print(f"  Q3  {row['label']:32} {row['tokens']:>4} tokens, finish {row['finish_reason']}, "
                  f"{format_seconds(row['wall_s'])}")
    if parallel is not None:
        print(f"  Q4  peak KV n={parallel['n']} shared / separate: "
              f"{parallel['shared']['peak_kv_bytes'] / parallel['separate']['peak_kv_bytes']:.3f}; prompt "
              f"{parallel['prompt_tokens']} tokens = {parallel['prompt_tokens'] // parallel['block_size']} full blocks + "
              f"{parallel['prompt_tokens'] % parallel['block_size']} tokens")
    if sampling is not None:
        print(f"  Q5  per request: greedy {format_seconds(sampling['greedy']['median'])}, filtered "
              f"{format_seconds(sampling['filtered']['median'])}, ratio {sampling['ratio']:.3f}")
    else:
        print("  Q5  the sampling timing: finish exercise 3")
    if structured is not None:
        c = structured["constrained"]
        print(f"  Q6  the mask: {format_seconds(c['mask_s'] / max(c['mask_steps'], 1))} per step, "
              f"{c['mask_s'] / max(c['steps_s'], 1e-9):.1%} of the constrained run's step time "
              f"({format_seconds(c['step_s'])} per step)")


__all__ += ["mask_reference", "make_mask_inputs", "MASK_CASES", "HIDDEN_MASK_CASES", "check_mask_kernel",
            "MaskKernelSampler", "print_mask_run", "check_mask_run", "time_mask_kernel", "print_mask_timing",
            "require_kernel", "REFERENCE_SAMPLING", "FakeSamplingEngine", "check_measure_sampling", "print_sampling",
            "sampling_figure", "print_your_numbers"]
