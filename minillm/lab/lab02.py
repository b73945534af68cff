"""Lab 02 helpers — the KV cache: checks, the engine adapter, the kv on/off view and printout, the
cache-size calculator. The kv on/off measurement (measure_kv_toggle, summarize_kv_toggle) and the
plug_in seam are written in the notebook itself, where the learner reads them. The learner's timing harness
(kv_step_ratio: warm-up, repeats, median and spread of a decode step with and without the cache, their ratio) is
checked here on fake steps and a FakeClock (check_kv_step_ratio), as are the store written as a Triton kernel
(check_store_kv; KernelStoreBackend runs it in the engine) and the short answer (check_answer_users_on_80gb).

The learner writes two functions with the engine's own contract (see layers/attention.py):

    append_kv(k_cache, v_cache, k_new, v_new, slots) -> None        # = backend.store_kv
    attend_with_cache(q, k, v, scale, num_cached) -> [num_q, num_heads, head_dim]  # = backend.attend

`LabAttentionBackend` wraps them so the real engine runs them (`llm.set_attention_backend`),
and the check_* functions compare them with the engine's torch backend, naming the wrong
element and the likely mistake.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import common
from .common import (CheckFailed, call_learner, call_repr, echo_prediction, expect_number, format_seconds, new_figure, passed,
                     require_kernel)

GROWTHS = ("linear", "quadratic")
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16 / fp16": 2, "fp8 / int8": 1}


# =================================================================== 1. predict: a FLOP model
def linear_params_per_layer(cfg) -> int:
    """Weights one token meets in one layer: q, k, v, o projections and the MLP."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    return cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size


def step_flops(cfg, context_len: int, kv_cache: bool) -> int:
    """FLOPs of the decode step whose sequence holds `context_len` tokens (its newest included).

    With a cache the step feeds one token: projections + MLP once, attention over
    `context_len` keys. Without, it feeds all `context_len` tokens again: the projections and
    MLP run `context_len` times and token p attends over p + 1 keys. Both compute the logits
    of the last token only (one vocab-sized matmul).
    """
    if context_len < 1:
        raise ValueError(f"context_len={context_len} must be >= 1")
    linear = 2 * cfg.num_layers * linear_params_per_layer(cfg)
    attn_per_key = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # q.k and p.v, 2 FLOPs each
    logits = 2 * cfg.hidden_size * cfg.vocab_size
    if kv_cache:
        return linear + attn_per_key * context_len + logits
    return linear * context_len + attn_per_key * context_len * (context_len + 1) // 2 + logits


def total_flops(cfg, prompt_len: int, num_new_tokens: int, kv_cache: bool) -> int:
    """FLOPs to generate `num_new_tokens` after a prompt (the prefill included)."""
    prefill = step_flops(cfg, prompt_len, kv_cache=False)
    return prefill + sum(step_flops(cfg, prompt_len + i, kv_cache) for i in range(1, num_new_tokens))


def flops_table(cfg, context_lens: Sequence[int] = (16, 64, 256, 1024, 4096)) -> list[dict]:
    """Per-step GFLOPs with and without the cache, and their ratio, at a few context lengths."""
    rows = []
    for n in context_lens:
        with_cache, without = step_flops(cfg, n, True), step_flops(cfg, n, False)
        rows.append({"context_len": n, "gflops_with_cache": with_cache / 1e9,
                     "gflops_without_cache": without / 1e9, "ratio": without / with_cache})
    return rows


def _growth_note(name: str, guess) -> str | None:
    """A line for a growth guess that is not one of GROWTHS (echo_prediction can only say 'not this time')."""
    if guess is not None and (not isinstance(guess, str) or guess.strip().lower() not in GROWTHS):
        return f"  ({name}: {guess!r} is not one of {GROWTHS})"
    return None


def reveal_predictions(cfg, predicted_flops_ratio_at_256=None, predicted_growth_without_cache=None,
                       predicted_growth_with_cache=None, context_len: int = 256) -> dict:
    """Print the FLOP model, then each of the learner's guesses beside the true value (echo_prediction:
    for the ratio, how far off it was); return the true values."""
    ratio = step_flops(cfg, context_len, False) / step_flops(cfg, context_len, True)
    print("FLOPs per decode step of this model (a count, not a measurement):")
    print(f"{'context':>9} {'with cache':>12} {'without':>12} {'ratio':>8}")
    for row in flops_table(cfg):
        print(f"{row['context_len']:>9} {row['gflops_with_cache']:>10.3f} G {row['gflops_without_cache']:>10.1f} G"
              f" {row['ratio']:>7.0f}x")
    print()
    guess = predicted_flops_ratio_at_256
    if guess is not None and (isinstance(guess, bool) or not isinstance(guess, (int, float))):
        print(f"  ({guess!r} is not a number: predicted_flops_ratio_at_256 is a ratio, e.g. 30)")
        guess = str(guess)
    echo_prediction(f"FLOPs without / with the cache at context {context_len} (counted)", guess, round(ratio, 1), unit="x")
    for name, guess, truth in (("total work without a cache", predicted_growth_without_cache, "quadratic"),
                               ("total work with a cache", predicted_growth_with_cache, "linear")):
        echo_prediction(name, guess.strip().lower() if isinstance(guess, str) else guess, truth)
        note = _growth_note(name, guess)
        if note:
            print(note)
    print("Why: without a cache step t re-runs all t tokens (work ~ t), so n steps cost ~ n²/2 token-passes;"
          " with one, each step runs 1 token (+ attention over t cached keys, small next to the weights).")
    return {"ratio": ratio, "growth_without_cache": "quadratic", "growth_with_cache": "linear"}


# =================================================================== 2. build: the adapter
class LabAttentionBackend:
    """An attention backend of layout "sequence" (minillm/seams.py: `store_kv` / `attend`) made of lab functions."""

    layout = "sequence"

    def __init__(self, append_kv: Callable, attend_with_cache: Callable):
        self.append_kv = append_kv
        self.attend_with_cache = attend_with_cache

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        self.append_kv(k_cache, v_cache, k, v, slot_mapping)

    def attend(self, q, k, v, scale, num_cached):
        return self.attend_with_cache(q, k, v, scale, num_cached)


# ------------------------------------------------------------------- references and mistakes
def _mask(num_q: int, num_keys: int, num_cached: int, kind: str = "causal") -> torch.Tensor:
    """[num_q, num_keys] bool: which keys each query may see (kind names a common mistake)."""
    q_pos = torch.arange(num_q).unsqueeze(1) + (0 if kind == "ignores_num_cached" else num_cached)
    k_pos = torch.arange(num_keys).unsqueeze(0)
    if kind == "strict":
        return k_pos < q_pos
    if kind == "one_ahead":
        return k_pos <= q_pos + 1
    if kind == "none":
        return torch.ones(num_q, num_keys, dtype=torch.bool)
    return k_pos <= q_pos


def _expand_kv(x: torch.Tensor, num_heads: int, kind: str = "interleave") -> torch.Tensor:
    group = num_heads // x.shape[0]
    return x.repeat_interleave(group, dim=0) if kind == "interleave" else x.repeat(group, 1, 1)


def reference_attend(q, k, v, scale, num_cached, mask_kind="causal", gqa_kind="interleave") -> torch.Tensor:
    """The engine's attention in float64 (via SDPA), or one of the usual mistakes."""
    num_q, num_heads, _ = q.shape
    mask = _mask(num_q, k.shape[1], num_cached, mask_kind).to(q.device)
    qh = q.double().transpose(0, 1)
    kh, vh = _expand_kv(k.double(), num_heads, gqa_kind), _expand_kv(v.double(), num_heads, gqa_kind)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _softmax_over_queries(q, k, v, scale, num_cached) -> torch.Tensor:
    num_heads = q.shape[1]
    scores = torch.einsum("qhd,hkd->hqk", q.double(), _expand_kv(k.double(), num_heads)) * scale
    scores = scores.masked_fill(~_mask(q.shape[0], k.shape[1], num_cached).to(q.device), float("-inf"))
    probs = torch.softmax(scores, dim=1).nan_to_num(0.0)
    return torch.einsum("hqk,hkd->qhd", probs, _expand_kv(v.double(), num_heads))


def _mistakes(q, k, v, scale, num_cached):
    """(output, explanation) for each common mistake that changes the result on these inputs."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    found = []
    if num_q > 1:
        found.append((reference_attend(q, k, v, scale, num_cached, "none"),
                      "every query saw every key, including keys after its own position: apply the causal mask "
                      "(query i may see keys 0..num_cached+i)"))
        found.append((reference_attend(q, k, v, scale, num_cached, "one_ahead"),
                      "your attention let query i see key num_cached+i+1, one step in its future: check the causal "
                      "mask with num_cached (keep key j when j <= num_cached + i)"))
    if num_cached > 0:
        found.append((reference_attend(q, k, v, scale, num_cached, "ignores_num_cached"),
                      f"your causal mask puts query i at position i, but it sits at position num_cached + i "
                      f"(num_cached = {num_cached} here): it must see all {num_cached} cached keys plus keys up to its own"))
    found.append((reference_attend(q, k, v, scale, num_cached, "strict"),
                  "query i could not see its own key: keep key j when j <= num_cached + i (<=, not <)"))
    if 1 < num_kv_heads < num_heads:
        found.append((reference_attend(q, k, v, scale, num_cached, gqa_kind="repeat"),
                      f"query head h read kv head h % num_kv_heads; it must read kv head h // (num_heads // num_kv_heads) "
                      f"(here heads 0..{group - 1} share kv head 0): use repeat_interleave, not repeat"))
    if abs(scale - 1.0) > 1e-6:
        found.append((reference_attend(q, k, v, 1.0, num_cached),
                      f"the scores were not scaled: multiply q·k by scale (= {scale:.4g} = 1/sqrt({head_dim})) before the softmax"))
        found.append((reference_attend(q, k, v, 1.0 / scale, num_cached),
                      "you divided the scores by scale; multiply (scale is already 1/sqrt(head_dim))"))
    if num_q > 1:
        found.append((_softmax_over_queries(q, k, v, scale, num_cached),
                      "the softmax ran over the queries; it must run over the keys (the last dimension of the scores)"))
    return found


def diagnose_attend(out: torch.Tensor, q, k, v, scale, num_cached, atol: float = 1e-4) -> str | None:
    """The likely mistake behind a wrong output, or None if no known mistake matches."""
    for candidate, why in _mistakes(q, k, v, scale, num_cached):
        # A query that sees no key gives NaN (or 0, depending on the softmax): treat both as 0.
        if torch.allclose(out.double().nan_to_num(0.0), candidate.nan_to_num(0.0), atol=atol, rtol=atol):
            return why
    return None


class _UsedSDPA(BaseException):
    """Raised by the refused SDPA: a BaseException, so call_learner (which turns a learner's crash into a
    CheckFailed) lets it through to the check that says what it means."""


@contextlib.contextmanager
def _no_sdpa():
    """Inside: F.scaled_dot_product_attention raises, so the check sees the mechanics are built by hand."""
    original = F.scaled_dot_product_attention

    def refuse(*args, **kwargs):
        raise _UsedSDPA()

    F.scaled_dot_product_attention = refuse
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _index_str(index: Sequence[int], names: Sequence[str]) -> str:
    return ", ".join(f"{n} {int(i)}" for n, i in zip(names, index))


# ------------------------------------------------------------------- check: append_kv
@dataclass(frozen=True)
class AppendCase:
    name: str
    num_kv_heads: int
    num_slots: int
    head_dim: int
    slots: tuple[int, ...]
    dtype: torch.dtype = torch.float32


APPEND_CASES = (
    AppendCase("prefill of 7 tokens into slots 10..16 (head_dim 80, 3 KV heads)", 3, 37, 80, tuple(range(10, 17))),
    AppendCase("one decode token into slot 23", 3, 37, 80, (23,)),
    AppendCase("5 tokens into scattered slots, out of order (as a paged cache does)", 3, 37, 80, (31, 2, 17, 8, 30)),
    AppendCase("one KV head (multi-query), head_dim 64", 1, 9, 64, (4, 5)),
    AppendCase("bfloat16 pool, 2 KV heads", 2, 20, 48, (0, 19, 7), torch.bfloat16),
)


def _append_failure(case: AppendCase, name: str, got, expected, new, slots) -> str:
    """Explain the first wrong element of one pool (k_cache or v_cache)."""
    wrong = (got != expected).nonzero()
    head, slot, dim = (int(i) for i in wrong[0])
    where = f"{name}[kv_head {head}, slot {slot}, dim {dim}] = {got[head, slot, dim].item():.4g}, expected {expected[head, slot, dim].item():.4g}"
    slot_list = list(slots.tolist())
    n = len(slot_list)
    if n <= got.shape[1] and torch.equal(got[:, :n], new.transpose(0, 1)) and slot_list != list(range(n)):
        return (f"{where}: token i went to slot i; it belongs in slot slots[i] (token 0 -> slot {slot_list[0]}, "
                f"token 1 -> slot {slot_list[1 % n]}, ...). Case: {case.name}.")
    if slot in slot_list:
        token = slot_list.index(slot)
        source = "k_new" if name == "k_cache" else "v_new"
        return (f"{where} (= {source}[token {token}, kv_head {head}, dim {dim}]): token {token} belongs in slot "
                f"slots[{token}] = {slot}, with all its KV heads. Note the layouts differ: {source} is "
                f"[num_tokens, num_kv_heads, head_dim], {name} is [num_kv_heads, num_slots, head_dim]. Case: {case.name}.")
    return (f"{where}: slot {slot} is not in slots {slot_list} but changed; it holds another token's K/V, "
            f"so write only the listed slots (in a kernel: the pool's element [kv_head, slot, dim] sits at "
            f"(kv_head * num_slots + slot) * head_dim + dim, and lanes past head_dim must be masked). Case: {case.name}.")


def check_append_kv(append_kv: Callable, cases: Sequence[AppendCase] = APPEND_CASES, seed: int = 0,
                    name: str = "append_kv") -> None:
    """Run `append_kv` on fresh random pools; say which element is wrong and why (``name``: the function's name in
    the messages, so the kernel's launcher is checked by the same code)."""
    gen = torch.Generator().manual_seed(seed)
    for case in cases:
        pools = [torch.randn(case.num_kv_heads, case.num_slots, case.head_dim, generator=gen).to(case.dtype) for _ in range(2)]
        news = [torch.randn(len(case.slots), case.num_kv_heads, case.head_dim, generator=gen).to(case.dtype) for _ in range(2)]
        slots = torch.tensor(case.slots, dtype=torch.int64)
        k_cache, v_cache = (p.clone() for p in pools)
        k_new, v_new = (n.clone() for n in news)
        returned = call_learner(append_kv, (k_cache, v_cache, k_new, v_new, slots.clone()),
                                f"{name}(k_cache {list(k_cache.shape)}, v_cache, k_new {list(k_new.shape)}, v_new, "
                                f"slots {list(case.slots)[:6]}{' ...' if len(case.slots) > 6 else ''}) [{case.dtype}]. "
                                f"Case: {case.name}",
                                "k_new is [num_tokens, num_kv_heads, head_dim], the pools [num_kv_heads, num_slots, head_dim]")
        expected = []
        for pool, new in zip(pools, news):
            e = pool.clone()
            e[:, slots] = new.transpose(0, 1)
            expected.append(e)
        if not torch.equal(k_new, news[0]) or not torch.equal(v_new, news[1]):
            raise CheckFailed(f"{name} changed k_new or v_new; it should only write into the pools. Case: {case.name}.")
        if torch.equal(k_cache, pools[0]) and torch.equal(v_cache, pools[1]):
            extra = " It returned a value, which the engine ignores." if returned is not None else ""
            raise CheckFailed(
                f"{name} left k_cache and v_cache unchanged: write into them in place, "
                f"since the engine keeps a reference to the pool and never sees a new tensor.{extra} Case: {case.name}.")
        if torch.equal(v_cache[:, slots], news[0].transpose(0, 1)) and not torch.equal(news[0], news[1]):
            raise CheckFailed(f"v_cache holds the keys: store k_new in k_cache and v_new in v_cache. Case: {case.name}.")
        for pool_name, got, exp, new in (("k_cache", k_cache, expected[0], news[0]), ("v_cache", v_cache, expected[1], news[1])):
            if got.shape != exp.shape or got.dtype != exp.dtype:
                raise CheckFailed(f"{pool_name} changed shape or dtype to {list(got.shape)} {got.dtype}; it must stay "
                                  f"{list(exp.shape)} {exp.dtype}. Case: {case.name}.")
            if not torch.equal(got, exp):
                raise CheckFailed(_append_failure(case, pool_name, got, exp, new, slots))
    passed(name, len(cases))


# ------------------------------------------------------------------- check: attend_with_cache
@dataclass(frozen=True)
class AttendCase:
    name: str
    num_q: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_cached: int


ATTEND_CASES = (
    AttendCase("prefill: 6 queries, nothing cached (GQA 9:3, head_dim 80)", 6, 9, 3, 80, 0),
    AttendCase("decode: 1 query after 11 cached keys", 1, 9, 3, 80, 11),
    AttendCase("4 new queries after 7 cached keys", 4, 9, 3, 80, 7),
    AttendCase("multi-head (4:4), 5 queries after 2 cached", 5, 4, 4, 64, 2),
    AttendCase("multi-query (6:1), 3 queries after 5 cached", 3, 6, 1, 32, 5),
)

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _attend_inputs(case: AttendCase, dtype, gen):
    num_keys = case.num_cached + case.num_q
    q = torch.randn(case.num_q, case.num_heads, case.head_dim, generator=gen)
    # Keys of distinct scale per position make every mistake (mask, head mapping, scale) visible.
    k = torch.randn(case.num_kv_heads, num_keys, case.head_dim, generator=gen) * 1.5
    v = torch.randn(case.num_kv_heads, num_keys, case.head_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), case.head_dim ** -0.5


def _first_wrong(out: torch.Tensor, expected: torch.Tensor, tol: float):
    bad = ~torch.isclose(out.double(), expected, atol=tol, rtol=tol)
    return tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else None


def _call_attend(attend_with_cache, q, k, v, scale, num_cached, context: str):
    inputs = [t.clone() for t in (q, k, v)]
    try:
        with _no_sdpa():
            out = call_learner(attend_with_cache, (q, k, v, scale, num_cached),
                               f"attend_with_cache(q {list(q.shape)}, k {list(k.shape)}, v, scale={scale:.4g}, "
                               f"num_cached={num_cached}). {context}")
    except _UsedSDPA:
        raise CheckFailed("attend_with_cache called F.scaled_dot_product_attention: build it from matmuls, a mask and "
                          "torch.softmax, so you see each step (the engine's backend is the one that may use SDPA)") from None
    for name, before, after in zip("qkv", inputs, (q, k, v)):
        if not torch.equal(before, after):
            raise CheckFailed(f"attend_with_cache changed its input {name} in place; in the engine k and v are views of "
                              f"the KV pool, so this corrupts the cache. Work on new tensors. {context}")
    return out


def _check_attend_output(out, q, k, v, scale, num_cached, context: str) -> None:
    num_q, num_heads, head_dim = q.shape
    if out is None:
        raise CheckFailed(f"attend_with_cache returned None: return the output, shaped [num_q, num_heads, head_dim]. {context}")
    if not isinstance(out, torch.Tensor):
        raise CheckFailed(f"attend_with_cache returned a {type(out).__name__}; return a torch.Tensor. {context}")
    want = [num_q, num_heads, head_dim]
    if list(out.shape) != want:
        hint = ""
        if list(out.shape) == [num_heads, num_q, head_dim]:
            hint = " It looks like [num_heads, num_q, head_dim]: transpose(0, 1) before returning."
        raise CheckFailed(f"attend_with_cache returned shape {list(out.shape)}, expected [num_q, num_heads, head_dim] = {want}.{hint} {context}")
    if out.dtype != q.dtype:
        raise CheckFailed(f"attend_with_cache returned {out.dtype}, expected q's dtype {q.dtype} "
                          f"(compute in float32 if you like, then .to(q.dtype)). {context}")
    expected = reference_attend(q, k, v, scale, num_cached)
    tol = TOLERANCE.get(q.dtype, 1e-4)
    wrong = _first_wrong(out, expected, tol)
    if wrong is None:
        return
    i, h, d = wrong
    group = num_heads // k.shape[0]
    where = (f"out[query {i}, head {h}, dim {d}] = {out[i, h, d].item():.4g}, expected {expected[i, h, d].item():.4g}. "
             f"Query {i} sits at position num_cached + {i} = {num_cached + i}, so it sees keys 0..{num_cached + i} "
             f"of kv head {h} // {group} = {h // group}.")
    if torch.isnan(out).any():
        where += " Your output has NaN: a row of scores with no visible key, or -inf minus -inf in the softmax?"
    why = diagnose_attend(out, q, k, v, scale, num_cached, atol=max(tol, 1e-4))
    raise CheckFailed(f"{context} {where}" + (f" Likely cause: {why}." if why else ""))


def check_attend_with_cache(attend_with_cache: Callable, cases: Sequence[AttendCase] = ATTEND_CASES,
                            dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    """Run `attend_with_cache` on fresh random inputs of odd shapes; name the wrong element and the likely cause."""
    gen = torch.Generator().manual_seed(seed)
    for case in cases:
        q, k, v, scale = _attend_inputs(case, dtype, gen)
        context = f"Case: {case.name} (q {list(q.shape)}, k/v {list(k.shape)}, num_cached {case.num_cached}, {dtype})."
        out = _call_attend(attend_with_cache, q, k, v, scale, case.num_cached, context)
        _check_attend_output(out, q, k, v, scale, case.num_cached, context)
    passed("attend_with_cache", len(cases))


# ------------------------------------------------------------------- check: in the engine
DEFAULT_CHECK_PROMPTS = (
    "The capital of France is",
    "Write a haiku about a lighthouse keeper who counts the stairs.",
    "def fibonacci(n):",
)


class CheckingBackend(LabAttentionBackend):
    """The lab backend, plus a record of the first call whose result differs from the engine's."""

    def __init__(self, append_kv, attend_with_cache):
        super().__init__(append_kv, attend_with_cache)
        self.num_attend_calls = 0
        self.first_problem: str | None = None

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        super().store_kv(k_cache, v_cache, k, v, slot_mapping)
        if self.first_problem is None:
            for name, pool, new in (("k_cache", k_cache, k), ("v_cache", v_cache, v)):
                if not torch.equal(pool[:, slot_mapping], new.transpose(0, 1).to(pool.dtype)):
                    self.first_problem = (f"after append_kv, {name}[:, slots] does not hold this step's "
                                          f"{'keys' if name == 'k_cache' else 'values'} (slots {slot_mapping.tolist()[:8]}...): "
                                          "later steps read stale K/V. Run check_append_kv for the details.")
                    break

    def attend(self, q, k, v, scale, num_cached):
        call = self.num_attend_calls
        self.num_attend_calls += 1
        out = self.attend_with_cache(q, k, v, scale, num_cached)
        if self.first_problem is None:
            kind = (f"a decode step (1 query, num_cached={num_cached})" if q.shape[0] == 1 and num_cached > 0
                    else f"a prefill ({q.shape[0]} queries, num_cached={num_cached})")
            context = f"First wrong call: attention call #{call}, {kind}, q {list(q.shape)}, k/v {list(k.shape)}."
            try:
                _check_attend_output(out, q, k, v, scale, num_cached, context)
            except CheckFailed as failure:
                self.first_problem = str(failure)
        return out


_REFERENCE_TOKENS: dict = {}


def reference_tokens(llm, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the engine's built-in torch backend (cached per engine and request)."""
    from .. import SamplingParams

    key = (id(llm.engine), llm.config.kv_cache, tuple(prompts), max_tokens)
    if key not in _REFERENCE_TOKENS:
        previous = llm.config.attention_backend
        llm.set_attention_backend("torch")
        try:
            outs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        finally:
            llm.set_attention_backend(previous)
        _REFERENCE_TOKENS[key] = [list(o.outputs[0].token_ids) for o in outs]
    return _REFERENCE_TOKENS[key]


def check_in_engine(append_kv: Callable, attend_with_cache: Callable, llm, prompts: Sequence[str] = DEFAULT_CHECK_PROMPTS,
                    max_tokens: int = 8) -> None:
    """Greedy generation with your functions plugged into `llm` must give the engine's own tokens."""
    from .. import SamplingParams

    prompts = list(prompts)
    llm = common.check_engine(llm)  # a small KV pool: each call of your functions gets one layer's pool
    expected = reference_tokens(llm, prompts, max_tokens)
    backend = CheckingBackend(append_kv, attend_with_cache)
    previous = llm.config.attention_backend
    llm.set_attention_backend(backend)
    try:
        try:
            outs = call_learner(llm.generate, (prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)),
                                f"llm.generate({prompts!r}, max_tokens={max_tokens}) with your append_kv and attend_with_cache "
                                f"in every layer ({'kv_cache=True' if llm.config.kv_cache else 'kv_cache=False'})")
        except CheckFailed as crash:  # the engine crashed on what your functions gave it: say which call went wrong first
            raise CheckFailed(f"{str(crash).rstrip('.')}. " + (backend.first_problem or "Run check_append_kv and check_attend_with_cache "
                                              "(the cells above) for the details.")) from crash
    finally:
        llm.set_attention_backend(previous)
    near_ties = []
    for p, (out, want) in enumerate(zip(outs, expected)):
        got = list(out.outputs[0].token_ids)
        t = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if t is None and len(got) != len(want):
            raise CheckFailed(f"prompt {p}: {len(got)} tokens, expected {len(want)}")
        if t is None:
            continue
        tok = llm.tokenizer
        where = "the first token, made by the prefill" if t == 0 else f"made by decode step {t}"
        message = (f"token {t} of prompt {p} ({prompts[p]!r}) differs ({where}): the engine gives {want[t]} "
                   f"({tok.decode([want[t]])!r}), your backend gave {got[t]} ({tok.decode([got[t]])!r}).")
        if backend.first_problem:
            raise CheckFailed(message + " " + backend.first_problem)
        # Every attention call matched the reference within the dtype's tolerance: the flip is a
        # near-tie between two tokens, decided by rounding (bf16 on a GPU), not a bug.
        near_ties.append(message)
    mode = "kv_cache=True" if llm.config.kv_cache else "kv_cache=False"
    message = (f"✓ your append_kv + attend_with_cache reproduce the engine's greedy tokens: {len(prompts)} prompts x "
               f"{max_tokens} tokens ({mode}, {backend.num_attend_calls} attention calls, {llm.device})")
    if near_ties:
        message += ("\n  (every attention call matched the engine within rounding, but a near-tie flipped: "
                    + " ".join(near_ties) + ")")
    print(message)


# =================================================================== 2b. build: the store as a Triton kernel
KERNEL_CASES = (
    AppendCase("prefill of 5 tokens into slots 3..7 (head_dim 64, 3 KV heads)", 3, 12, 64, tuple(range(3, 8))),
    AppendCase("one decode token into slot 9, head_dim 80 (lanes 80..127 of BLOCK_D masked)", 3, 12, 80, (9,)),
    AppendCase("4 tokens into scattered slots, out of order, head_dim 80", 2, 11, 80, (10, 0, 6, 3)),
)
HIDDEN_KERNEL_CASES = (
    AppendCase("one KV head, head_dim 48, the last slot", 1, 6, 48, (5, 0)),
    AppendCase("float16 pool, 4 KV heads, head_dim 32", 4, 9, 32, (8, 1, 4), torch.float16),
)


def check_store_kv(store_kv: Callable, cases: Sequence[AppendCase] = KERNEL_CASES, seed: int = 0) -> None:
    """Your kernel's launcher (the contract of append_kv) on fresh random pools, at small shapes (Triton's
    interpreter on a CPU): every listed slot holds its token's K/V, every other slot keeps what it held."""
    check_append_kv(store_kv, cases, seed, name="store_kv")


class KernelStoreBackend:
    """An attention backend of layout "sequence" (minillm/seams.py): this step's K and V go into the pool through
    your kernel's launcher `store_kv`, attention is the engine's own (torch). It counts your launches and their time."""

    layout = "sequence"

    def __init__(self, store_kv: Callable):
        from ..layers.attention import TorchAttentionBackend

        self.store = store_kv
        self.torch = TorchAttentionBackend()
        self.num_kernel_calls = 0
        self.kernel_s = 0.0

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        with common.Stopwatch() as sw:
            self.store(k_cache, v_cache, k.contiguous(), v.contiguous(), slot_mapping)
        self.num_kernel_calls += 1
        self.kernel_s += sw.seconds

    def attend(self, q, k, v, scale, num_cached):
        return self.torch.attend(q, k, v, scale, num_cached)


def print_kernel_run(result: dict) -> None:
    """Your kernel's tokens against the engine's own backend's (they must be equal: a store copies bits)."""
    common.print_kernel_run(result, [("the engine's own backend", result["expected"], "")], result["kernel_calls"],
                            "your kernel, one launch per layer per step")


def time_store_kv(store_kv: Callable, num_tokens: int = 256, num_kv_heads: int = 8, head_dim: int = 128,
                  num_slots: int = 65536, dtype=torch.float16) -> dict:
    """On a GPU: your store vs the engine's store_kv kernel vs the time to read the new K/V and write them once."""
    from ..hardware import measure_memory_bandwidth

    if not torch.cuda.is_available():
        return {"device": "cpu"}
    from ..kernels.store_kv import store_kv as engine_store_kv

    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = (torch.zeros(num_kv_heads, num_slots, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(num_slots, device="cuda", generator=gen)[:num_tokens]
    moved = 2 * 2 * k.numel() * k.element_size()   # K and V, each read once and written once
    bandwidth = measure_memory_bandwidth("cuda")
    return {"device": common.device_label("cuda"), "bandwidth": bandwidth, "moved_bytes": moved,
            "shape": f"{num_tokens} tokens x {num_kv_heads} KV heads x {head_dim} into {num_slots:,} slots, {dtype}",
            "yours_s": common.gpu_seconds(lambda: store_kv(k_cache, v_cache, k, v, slots)),
            "engine_s": common.gpu_seconds(lambda: engine_store_kv(k_cache, v_cache, k, v, slots))}


def print_kernel_timing(result: dict) -> None:
    common.print_kernel_timing(result, [("yours", "moved_bytes"), ("engine", "moved_bytes")],
                               "and the engine's store_kv on 256 tokens x 8 KV heads x 128 (fp16), against the "
                               "time to move their bytes once at the measured bandwidth")


# =================================================================== 3. toggle: kv on vs off
def print_kv_toggle_summary(summary: dict) -> None:
    w, wo = summary["with cache"], summary["without cache"]
    n = w["last_context_len"]
    print(f"measured on {summary['device']}")
    print(f"  step at context {n}: {w['last_step_ms']:.1f} ms with the cache, {wo['last_step_ms']:.1f} ms without "
          f"({summary['last_step_ratio']:.1f}x)")
    print(f"  all steps: {format_seconds(w['total_s'])} with, {format_seconds(wo['total_s'])} without ({summary['total_ratio']:.1f}x)")
    print(f"  each extra context token adds {wo['ms_per_extra_token']:+.2f} ms per step without the cache, "
          f"{w['ms_per_extra_token']:+.3f} ms with it (least-squares slope; noisy on a shared machine)")
    if "flops_ratio_at_last" in summary:
        flops_ratio = summary["flops_ratio_at_last"]
        why = ("smaller: the cached step does few FLOPs but still reads every weight (see part 5)"
               if summary["last_step_ratio"] < flops_ratio else "as large: here both steps are bound by arithmetic")
        print(f"  the FLOP count predicts {flops_ratio:.0f}x at context {n}; the measured gap is {why}")
    if summary["same_tokens"]:
        print("  same tokens both ways: the cache changes the cost, not the result")
    else:
        print(f"  the tokens differ from token {summary.get('first_different_token')} on: the two paths multiply "
              "matrices of different shapes, so rounding differs and can flip a near-tie (more likely in bf16)")


SPEEDUP_TAIL = 4  # the toggle summary: a run's step time is the median of its last SPEEDUP_TAIL decode steps


def made_up_run(with_cache_s: Sequence[float], without_cache_s: Sequence[float], prompt_len: int = 16,
                device: str = "made up") -> dict:
    """A measure_kv_toggle result with these step durations (seconds; step 0 is the prefill, the rest decode
    steps), for checking the summary on numbers whose answer is known."""
    if len(with_cache_s) != len(without_cache_s) or not with_cache_s:
        raise ValueError("made_up_run: give both runs the same number of steps, at least 1")
    n = len(with_cache_s)
    contexts = [prompt_len + i for i in range(n)]
    kinds = ["prefill"] + ["decode"] * (n - 1)
    return {"device": device, "prompt_len": prompt_len, "num_steps": n, "same_tokens": True, "first_different_token": None,
            "with cache": {"context_len": contexts, "duration_s": list(with_cache_s), "kind": kinds,
                           "num_tokens": [prompt_len] + [1] * (n - 1), "total_s": sum(with_cache_s)},
            "without cache": {"context_len": contexts, "duration_s": list(without_cache_s), "kind": list(kinds),
                              "num_tokens": contexts, "total_s": sum(without_cache_s)}}


def _decode_durations(run: dict) -> list[float]:
    return [d for d, kind in zip(run["duration_s"], run["kind"]) if kind == "decode"]


def reference_kv_speedup(result: dict) -> tuple[float | None, float]:
    """(step_ratio, total_ratio) of a kv on/off run, as the summary reports them: the median of the last SPEEDUP_TAIL decode steps
    without the cache over the same with it (None when a run has no decode step), and the sum of every step's
    duration (the prefill included) without over with."""
    tails = [_decode_durations(result[label])[-SPEEDUP_TAIL:] for label in ("with cache", "without cache")]
    step = None if not all(tails) else statistics.median(tails[1]) / statistics.median(tails[0])
    return step, sum(result["without cache"]["duration_s"]) / sum(result["with cache"]["duration_s"])


# =================================================================== 3. measure: a decode step with and without the cache
# The course's reference run, on the machine the course was written on: the notebook's measurement cell in full mode
# (MINILLM_QUICK unset: STEP_PROMPT_LEN = 256, 2 warm-up and 10 timed decode steps per engine, SmolLM2-135M in fp32),
# i.e. kv_step_ratio(DecodeStepper(LLM(), ids, 12), DecodeStepper(LLM().with_levers(kv_cache=False), ids, 12),
# warmup=2, repeats=10) with ids = common.prompt_token_ids(tokenizer, 256). The machine was shared with several
# other jobs (the engine ran on 1 thread), so the times are slower than an idle 2-core run; the ratio, a quotient
# of two times taken under the same load, is what to compare.
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
REFERENCE_PROMPT_LEN = 256
REFERENCE_STEP_S = {"with cache": 0.243, "without cache": 6.32}   # median seconds per decode step
REFERENCE_STEP_RATIO = 26.0                                        # without / with


class DecodeStepper:
    """One sequence in `llm`'s engine, its prompt already prefilled (not timed): each call runs ONE engine step,
    a decode step at the next context length, for at most `num_steps` calls. With kv_cache=False the engine
    recomputes the whole sequence in that step; with the cache it runs one token and reads the rest."""

    def __init__(self, llm, prompt_ids: Sequence[int], num_steps: int):
        from .. import SamplingParams

        if num_steps < 1:
            raise ValueError(f"DecodeStepper(num_steps={num_steps!r}): at least 1 decode step")
        engine = llm.engine
        if engine.has_unfinished():
            raise RuntimeError("DecodeStepper: the engine is already running a request; let it finish first")
        params = SamplingParams(max_tokens=num_steps + 1, temperature=0, ignore_eos=True)
        self.engine, self.num_steps, self.calls = engine, num_steps, 0
        self.seq = engine.add_request(list(prompt_ids), params)
        while self.seq.first_token_s is None and not self.seq.is_finished:   # the prefill (perhaps in chunks)
            engine.step()
        self.context_len = len(prompt_ids)

    def __call__(self) -> None:
        if self.calls >= self.num_steps:
            raise RuntimeError(f"DecodeStepper: all {self.num_steps} decode steps are spent; make a new one "
                               "(num_steps = warmup + repeats)")
        self.calls += 1
        self.context_len += 1
        self.engine.step()


class FakeStep:
    """A stand-in for a DecodeStepper in the check: each call moves `clock` by the next scripted cost; nothing runs.
    It counts its calls (``calls``), so the check can see the warm-up happened."""

    def __init__(self, clock: common.FakeClock, costs: Sequence[float], label: str):
        self.clock, self.costs, self.label = clock, list(costs), label
        self.calls = 0

    def __call__(self) -> None:
        self.clock.advance(self.costs[min(self.calls, len(self.costs) - 1)])
        self.calls += 1

    def __repr__(self) -> str:
        return f"<fake decode step, {self.label}>"


def reference_step_timing(costs: Sequence[float], warmup: int) -> dict:
    """What a correct harness reports for steps costing `costs` (warm-up first): median, min, max of the timed ones."""
    summary = common.timing_summary(list(costs)[warmup:])
    return {"median": summary["median"], "min": summary["min"], "max": summary["max"]}


STEP_TIMING_CASES = (  # (the case in words, warmup, repeats, seed, with-cache base seconds, without-cache base seconds)
    ("2 warm-up and 5 timed steps, one slow outlier each", 2, 5, 1, 0.02, 0.15),
    ("1 warm-up and 4 timed steps (an even count: the median averages the middle two)", 1, 4, 2, 0.03, 0.12),
    ("no warm-up, 3 timed steps", 0, 3, 3, 0.01, 0.05),
)


def check_kv_step_ratio(kv_step_ratio: Callable, cases=STEP_TIMING_CASES) -> None:
    """kv_step_ratio(step_with_cache, step_without_cache, clock, warmup, repeats) on fake decode steps that move a
    FakeClock by known costs (warm-up steps 20x slower, one timed step 4x): each must be called warmup + repeats
    times, the warm-up dropped, each one's median, min and max are those of its timed steps, and the ratio is
    without / with."""
    for name, warmup, repeats, seed, fast, slow in cases:
        clock = common.FakeClock()
        costs = {"with cache": common.scripted_costs(fast, warmup, repeats, seed),
                 "without cache": common.scripted_costs(slow, warmup, repeats, seed + 100)}
        steps = {label: FakeStep(clock, costs[label], label) for label in costs}
        call = (f"kv_step_ratio(<fake step with cache>, <fake step without cache>, clock=FakeClock(), "
                f"warmup={warmup}, repeats={repeats}). Case: {name}")
        got = call_learner(kv_step_ratio, (steps["with cache"], steps["without cache"], clock, warmup, repeats), call)
        if clock.reads == 0:
            raise CheckFailed(f"{call}: your code never read `clock`: time with the clock you are given "
                              "(start = clock() ... clock() - start), not time.perf_counter, so the check can "
                              "script what each step costs")
        for label, step in steps.items():
            if step.calls != warmup + repeats:
                raise CheckFailed(f"{call}: step_{label.replace(' ', '_')} was called {step.calls} times; expected "
                                  f"warmup + repeats = {warmup + repeats} (warm up, then time `repeats` calls)")
        if not isinstance(got, dict) or not {"with cache", "without cache", "ratio"} <= set(got):
            raise CheckFailed(f"{call} returned {got!r}; return a dict with keys 'with cache', 'without cache' "
                              "(each {'median', 'min', 'max'} in seconds) and 'ratio'")
        for label in ("with cache", "without cache"):
            want = reference_step_timing(costs[label], warmup)
            summary = got[label]
            if not isinstance(summary, dict) or not {"median", "min", "max"} <= set(summary):
                raise CheckFailed(f"{call}: [{label!r}] = {summary!r}; expected a dict with 'median', 'min', 'max'")
            for key in ("median", "min", "max"):
                value = summary[key]
                if common.is_close(value, want[key], rel=1e-6):
                    continue
                why = common.timing_mistake(value, costs[label], warmup) if key == "median" else ""
                if key != "median" and common.is_close(value, (min if key == "min" else max)(costs[label]), rel=1e-6):
                    why = "the spread kept a warm-up step: take min and max of the timed steps only"
                if not why and clock.reads and value is not None and common.is_close(value, 0.0, abs_tol=1e-3):
                    why = "a real time, not the clock's: read `clock()`, not time.perf_counter()"
                shown = f"{float(value):.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
                raise CheckFailed(f"{call}: [{label!r}][{key!r}] = {shown}, expected {want[key]:.6g} s"
                                  + (f": that is {why}" if why else ""))
        ratio = got["ratio"]
        want_ratio = reference_step_timing(costs["without cache"], warmup)["median"] / \
            reference_step_timing(costs["with cache"], warmup)["median"]
        if not common.is_close(ratio, want_ratio, rel=1e-6):
            hint = ("it is upside down: the time WITHOUT the cache over the time WITH it (> 1 when the cache helps)"
                    if common.is_close(ratio, 1 / want_ratio, rel=1e-6) else "the median without the cache over the median with it")
            raise CheckFailed(f"{call}: ratio = {ratio!r}, expected {want_ratio:.6g}: {hint}")
    passed("kv_step_ratio", len(cases))


def plot_step_times(result: dict, device: str | None = None):
    """Median seconds per decode step with and without the cache, the min-max spread as error bars."""
    import plotly.graph_objects as go

    labels = ["with cache", "without cache"]
    med = [result[k]["median"] * 1e3 for k in labels]
    fig = new_figure(f"One decode step, with and without the KV cache: {result['ratio']:.1f}x", "",
                     "ms per decode step (median; bars: min to max)", device=device, log_y=True)
    fig.add_trace(go.Bar(x=labels, y=med, marker_color=["#2a9d8f", "#e76f51"],
                         error_y=dict(type="data", symmetric=False,
                                      array=[result[k]["max"] * 1e3 - m for k, m in zip(labels, med)],
                                      arrayminus=[m - result[k]["min"] * 1e3 for k, m in zip(labels, med)]),
                         text=[f"{m:.1f} ms" for m in med], textposition="outside"))
    return fig


def print_step_ratio(result: dict, context_len: int) -> None:
    """Your two medians and their ratio, beside the course's reference run."""
    for label in ("with cache", "without cache"):
        r = result[label]
        print(f"{label:>13}: {format_seconds(r['median'])} per decode step (min {format_seconds(r['min'])}, "
              f"max {format_seconds(r['max'])})")
    common.print_beside_reference(f"decode step at context ~{context_len}, without / with the cache",
                                  result["ratio"], REFERENCE_STEP_RATIO,
                                  f"{REFERENCE_HARDWARE}, context ~{REFERENCE_PROMPT_LEN}", unit="x")


class KVToggleView:
    """Per-step time (or running total) vs context length, kv_cache on vs off: a FigureWidget
    and a ToggleButtons that switches the view. `view.toggle.value = "total time"` in tests."""

    VIEWS = ("time per step", "total time")

    def __init__(self, result: dict):
        import ipywidgets as widgets

        self.result = result
        self.toggle = widgets.ToggleButtons(options=self.VIEWS, value=self.VIEWS[0], description="show")
        self.figure = new_figure("Decode with and without the KV cache", "context length (tokens in the sequence)",
                                 "ms per step", device=result["device"], widget=True, height=420)
        for label, color in (("with cache", "#2a9d8f"), ("without cache", "#e76f51")):
            s = result[label]
            self.figure.add_scatter(x=s["context_len"], y=self._y(label, self.VIEWS[0]), mode="lines+markers",
                                    name=f"kv_cache={label == 'with cache'}", line=dict(color=color),
                                    text=s["kind"], hovertemplate="context %{x}: %{y:.3g} (%{text})<extra></extra>")
        self.toggle.observe(self._on_toggle, names="value")
        self.widget = widgets.VBox([self.toggle, self.figure])

    def _y(self, label: str, view: str) -> list[float]:
        durations = self.result[label]["duration_s"]
        if view == "time per step":
            return [1e3 * d for d in durations]
        running, total = [], 0.0
        for d in durations:
            total += d
            running.append(total)
        return running

    def _on_toggle(self, change) -> None:
        view = change["new"]
        with self.figure.batch_update():
            for trace, label in zip(self.figure.data, ("with cache", "without cache")):
                trace.y = self._y(label, view)
            self.figure.layout.yaxis.title.text = "ms per step" if view == "time per step" else "seconds since the prompt arrived"

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


# =================================================================== 4. cache size with GQA
@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    note: str = ""


MODEL_SHAPES: dict[str, ModelShape] = {
    "SmolLM2-135M (GQA 9:3)": ModelShape(30, 3, 64, 134.5e6),
    "Llama-2-7B (MHA, 32 KV heads)": ModelShape(32, 32, 128, 6.74e9),
    "Llama-3.1-8B (GQA 32:8)": ModelShape(32, 8, 128, 8.03e9),
    "Llama-2-70B (GQA 64:8)": ModelShape(80, 8, 128, 68.98e9),
    "Llama-2-70B without GQA (64 KV heads)": ModelShape(80, 64, 128, 68.98e9, "hypothetical"),
}


def device_memory_bytes(device: str = "auto") -> tuple[int, str]:
    """Memory of the device the engine runs on: GPU memory, else the machine's RAM."""
    from ..hardware import device_name, resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        return total, f"{device_name(dev)} memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, f"{device_name(dev)} RAM"


# ------------------------------------------------------------------- checks: the cache's size
SIZE_CASES = (  # (the case in words, num_layers, num_kv_heads, head_dim, bytes_per_value)
    ("SmolLM2-135M, bf16", 30, 3, 64, 2),
    ("SmolLM2-135M, fp32 (this engine on a CPU)", 30, 3, 64, 4),
    ("Llama-2-7B, fp16", 32, 32, 128, 2),
    ("Llama-2-70B (GQA, 8 KV heads), fp16", 80, 8, 128, 2),
    ("Llama-3.1-8B, fp8 (1 byte per value)", 32, 8, 128, 1),
    ("a model of 0 layers (degenerate: nothing to cache)", 0, 8, 128, 2),
)


def _bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value) -> float:
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_value


def _size_hint(actual, expected: float, bytes_per_value) -> str:
    try:
        ratio = float(actual) / expected if expected else None
    except (TypeError, ValueError):
        return ""
    if ratio is None:
        return ""
    # The cases run 2-byte values first, so a ratio of 2 / bytes_per_value later means bytes_per_value was ignored.
    if bytes_per_value != 2 and math.isclose(ratio, 2 / bytes_per_value):
        return "you used 2 bytes per value whatever bytes_per_value says"
    if math.isclose(ratio, 0.5):
        return "half the answer: count the keys AND the values (the factor 2)"
    if math.isclose(ratio, 8):
        return "8x too many: bytes_per_value is already in bytes, not bits"
    if math.isclose(ratio, 1e-9) or math.isclose(ratio, 2**-30):
        return "return bytes, not GB or GiB"
    return ""


def check_kv_cache_bytes_per_token(kv_cache_bytes_per_token: Callable) -> None:
    """Bytes of K and V per token for a few real models, and a degenerate one; says what a wrong count forgot."""
    for name, *args in SIZE_CASES:
        expected = _bytes_per_token(*args)
        got = call_learner(kv_cache_bytes_per_token, tuple(args), f"{call_repr('kv_cache_bytes_per_token', args)} ({name})")
        expect_number("kv_cache_bytes_per_token", args, got, expected,
                      f"{name}: 2 x {args[0]} layers x {args[1]} KV heads x {args[2]} x {args[3]} bytes"
                      + (f"; {_size_hint(got, expected, args[3])}" if _size_hint(got, expected, args[3]) else ""))
    passed("kv_cache_bytes_per_token", len(SIZE_CASES))


TOTAL_CASES = (  # (the case in words, num_users, tokens_per_user, num_layers, num_kv_heads, head_dim, bytes_per_value)
    ("16 users x 4,000 tokens on Llama-2-7B, fp16", 16, 4000, 32, 32, 128, 2),
    ("1 user, 1 token of SmolLM2-135M in fp32", 1, 1, 30, 3, 64, 4),
    ("3 users x 1,000 tokens of SmolLM2-135M in bf16", 3, 1000, 30, 3, 64, 2),
    ("0 users (an idle server holds no cache)", 0, 4000, 32, 32, 128, 2),
    ("64 users x 8,192 tokens on Llama-2-70B (GQA), fp16", 64, 8192, 80, 8, 128, 2),
)


def check_kv_cache_bytes(kv_cache_bytes: Callable) -> None:
    """Bytes of KV cache for num_users sequences of tokens_per_user tokens; says what a wrong total forgot."""
    for name, users, tokens, *shape in TOTAL_CASES:
        args = (users, tokens, *shape)
        per_token = _bytes_per_token(*shape)
        expected = users * tokens * per_token
        got = call_learner(kv_cache_bytes, args, f"{call_repr('kv_cache_bytes', args)} ({name})")
        hint = f"{name}: {users} users x {tokens:,} tokens x {per_token:,} bytes per token"
        try:
            value = float(got)
        except (TypeError, ValueError):
            value = None
        if value is not None and expected:
            if math.isclose(value, tokens * per_token):
                hint += "; you left out num_users"
            elif math.isclose(value, users * per_token):
                hint += "; you left out tokens_per_user"
            elif math.isclose(value, users * tokens * tokens * per_token):
                hint += "; tokens_per_user counted twice"
            elif _size_hint(value, expected, shape[-1]):
                hint += f"; {_size_hint(value, expected, shape[-1])}"
        expect_number("kv_cache_bytes", args, got, expected, hint)
    passed("kv_cache_bytes", len(TOTAL_CASES))


# ------------------------------------------------------------------- the short answer: users on one GPU
GPU_BYTES = 80e9  # "an 80 GB GPU": 80 x 10^9 bytes (an H100 80GB), the course's GB


def users_that_fit(model: str = "Llama-2-7B (MHA, 32 KV heads)", tokens_per_user: int = 4000, bytes_per_value: float = 2,
                   memory_bytes: float = GPU_BYTES) -> int:
    """Whole users whose cache of tokens_per_user tokens fits in memory_bytes next to the weights (same dtype)."""
    shape = MODEL_SHAPES[model]
    free = memory_bytes - shape.num_params * bytes_per_value
    per_user = tokens_per_user * _bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, bytes_per_value)
    return max(0, math.floor(free / per_user))


def check_answer_users_on_80gb(answer) -> None:
    """answer_users_on_80gb: how many users of 4,000 tokens fit on an 80 GB GPU next to Llama-2-7B's fp16 weights."""
    model = "Llama-2-7B (MHA, 32 KV heads)"
    shape = MODEL_SHAPES[model]
    per_user = 4000 * _bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, 2)
    weights = shape.num_params * 2
    right = users_that_fit(model)
    said = f"answer_users_on_80gb = {answer!r}"
    if answer is None or isinstance(answer, bool) or not isinstance(answer, (int, float)):
        raise CheckFailed(f"{said}: set it to a whole number of users")
    if answer != int(answer):
        raise CheckFailed(f"{said}: a whole number of users (a user whose cache does not fit whole does not fit): "
                          f"round down")
    wrong = {
        math.ceil((GPU_BYTES - weights) / per_user): "you rounded up: the last user's cache does not fit whole, round down",
        math.floor(GPU_BYTES / per_user): f"you left out the weights: {weights / 1e9:.2f} GB of the 80 GB hold the model",
        users_that_fit(model, memory_bytes=80 * 2**30): "80 GB is 80 x 10^9 bytes here, not 80 GiB (2^30 bytes each)",
        math.floor((GPU_BYTES - weights) / (per_user / 2)): "each token stores a key AND a value: 2 x layers x kv_heads x "
                                                           "head_dim x bytes",
        math.floor((GPU_BYTES - weights) / (per_user * 2)): "fp16 is 2 bytes per value, not 4",
    }
    wrong.pop(right, None)
    if int(answer) != right:
        why = wrong.get(int(answer), f"each user needs {per_user / 1e9:.3f} GB of cache (4,000 tokens x "
                                     f"{per_user // 4000:,} bytes), and {(GPU_BYTES - weights) / 1e9:.2f} GB are left "
                                     "next to the weights")
        raise CheckFailed(f"{said} is not right: {why}")
    print(f"✓ answer_users_on_80gb: {right} users ({(GPU_BYTES - weights) / 1e9:.2f} GB free / {per_user / 1e9:.3f} GB each)")


def worked_examples(kv_cache_bytes_per_token: Callable) -> list[dict]:
    """Bytes per token of the reference models, computed with the learner's function."""
    rows = []
    for name, shape in MODEL_SHAPES.items():
        for dtype, nbytes in (("fp32", 4), ("bf16 / fp16", 2)) if name.startswith("SmolLM2") else (("bf16 / fp16", 2),):
            per_token = kv_cache_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, nbytes)
            rows.append({"model": name, "dtype": dtype, "layers": shape.num_layers, "kv_heads": shape.num_kv_heads,
                         "head_dim": shape.head_dim, "bytes_per_token": per_token,
                         "tokens_per_gb": 1e9 / per_token if per_token else float("inf")})
    return rows


def print_worked_examples(rows: list[dict]) -> None:
    print(f"{'model':<40} {'dtype':<12} {'layers':>6} {'kv heads':>8} {'head_dim':>8} {'bytes/token':>12} {'tokens/GB':>10}")
    for r in rows:
        print(f"{r['model']:<40} {r['dtype']:<12} {r['layers']:>6} {r['kv_heads']:>8} {r['head_dim']:>8} "
              f"{r['bytes_per_token']:>12,} {r['tokens_per_gb']:>10,.0f}")


class KVSizeExplorer:
    """Sliders (users, tokens per user) and dropdowns (model, dtype) driving a FigureWidget of
    KV cache GB vs number of users, with the weights stacked on and the device's memory as a line.

    `kv_cache_bytes(num_users, tokens_per_user, num_layers, num_kv_heads, head_dim, bytes_per_value)`
    is the learner's function. GB = 1e9 bytes.
    """

    MAX_USERS = 64

    def __init__(self, kv_cache_bytes: Callable, model: str = "Llama-2-7B (MHA, 32 KV heads)", num_users: int = 16,
                 tokens_per_user: int = 4000, dtype: str = "bf16 / fp16", device: str = "auto"):
        import ipywidgets as widgets

        self.kv_cache_bytes = kv_cache_bytes
        self.memory_bytes, memory_label = device_memory_bytes(device)
        self.users = widgets.IntSlider(value=num_users, min=1, max=self.MAX_USERS, description="users")
        self.context = widgets.IntSlider(value=tokens_per_user, min=256, max=32768, step=256, description="tokens/user",
                                         style={"description_width": "initial"})
        self.model = widgets.Dropdown(options=list(MODEL_SHAPES), value=model, description="model",
                                      layout=widgets.Layout(width="420px"))
        self.dtype = widgets.Dropdown(options=list(DTYPE_BYTES), value=dtype, description="dtype")
        self.readout = widgets.HTML()
        self.figure = new_figure("KV cache size vs number of users", "concurrent users", "GB (1e9 bytes)",
                                 device=f"model: memory line is {memory_label}", widget=True, height=430)
        self.figure.add_scatter(name="KV cache", mode="lines", line=dict(color="#e76f51"))
        self.figure.add_scatter(name="KV cache + weights", mode="lines", line=dict(color="#264653", dash="dash"))
        self.figure.add_scatter(name=memory_label, mode="lines", line=dict(color="#8d99ae", dash="dot"))
        self.figure.add_scatter(name="your setting", mode="markers", marker=dict(size=12, color="#e76f51"))
        for control in (self.users, self.context, self.model, self.dtype):
            control.observe(self.update, names="value")
        self.update()
        self.widget = widgets.VBox([widgets.HBox([self.users, self.context]), widgets.HBox([self.model, self.dtype]),
                                    self.readout, self.figure])

    def cache_gb(self, num_users: int) -> float:
        shape = MODEL_SHAPES[self.model.value]
        nbytes = self.kv_cache_bytes(num_users, self.context.value, shape.num_layers, shape.num_kv_heads,
                                     shape.head_dim, DTYPE_BYTES[self.dtype.value])
        return nbytes / 1e9

    def update(self, change=None) -> None:
        shape = MODEL_SHAPES[self.model.value]
        users = list(range(1, self.MAX_USERS + 1))
        cache = [self.cache_gb(u) for u in users]
        weights_gb = shape.num_params * DTYPE_BYTES[self.dtype.value] / 1e9
        memory_gb = self.memory_bytes / 1e9
        chosen = self.users.value
        with self.figure.batch_update():
            self.figure.data[0].update(x=users, y=cache)
            self.figure.data[1].update(x=users, y=[c + weights_gb for c in cache])
            self.figure.data[2].update(x=[users[0], users[-1]], y=[memory_gb, memory_gb])
            self.figure.data[3].update(x=[chosen], y=[cache[chosen - 1]])
            self.figure.layout.title.text = (f"KV cache of {self.model.value}, {self.context.value:,} tokens per user, "
                                             f"{self.dtype.value}")
        chosen_gb = cache[chosen - 1]
        fits = chosen_gb + weights_gb <= memory_gb
        max_users = max((u for u, c in zip(users, cache) if c + weights_gb <= memory_gb), default=0)
        self.readout.value = (
            f"<b>{chosen} users × {self.context.value:,} tokens</b>: KV cache {chosen_gb:,.2f} GB "
            f"({chosen_gb * 1e9 / 2**30:,.2f} GiB), {chosen_gb / weights_gb:.2f}× the weights ({weights_gb:,.2f} GB). "
            f"{'Fits' if fits else 'Does not fit'} in {memory_gb:,.0f} GB; at most {max_users} users fit "
            f"(of {self.MAX_USERS} shown).")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


# =================================================================== 5. explain: decode's bytes
def decode_step_traffic(shape: ModelShape, bytes_per_value: float, batch: int, context_len: int) -> dict:
    """Bytes read and FLOPs of one decode step for `batch` users at `context_len` tokens each.

    Weights are read once per step for the whole batch (2 FLOPs per weight per user); each
    user's cache is read once for that user alone. Attention FLOPs are left out: they add
    only a few FLOPs per cached value, so they do not change the picture.
    """
    weight_bytes = shape.num_params * bytes_per_value
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * bytes_per_value
    kv_bytes = batch * context_len * kv_per_token
    flops = 2 * shape.num_params * batch
    return {"batch": batch, "context_len": context_len, "weight_gb": weight_bytes / 1e9, "kv_gb": kv_bytes / 1e9,
            "kv_share": kv_bytes / (kv_bytes + weight_bytes), "flops_per_byte": flops / (kv_bytes + weight_bytes)}


def print_decode_traffic(model: str = "Llama-2-7B (MHA, 32 KV heads)", bytes_per_value: float = 2,
                         batches: Sequence[int] = (1, 16), context_lens: Sequence[int] = (512, 4000, 16000)) -> list[dict]:
    shape = MODEL_SHAPES[model]
    rows = [decode_step_traffic(shape, bytes_per_value, b, n) for b in batches for n in context_lens]
    print(f"one decode step of {model}, {bytes_per_value} bytes per value (a count, not a measurement)")
    print(f"{'users':>5} {'context':>8} {'weights GB':>11} {'KV GB':>8} {'KV share':>9} {'FLOP/byte':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context_len']:>8,} {r['weight_gb']:>11.1f} {r['kv_gb']:>8.1f} "
              f"{r['kv_share']:>8.0%} {r['flops_per_byte']:>10.2f}")
    return rows


def bytes_to_human(nbytes: float) -> str:
    """'33.55 GB (31.25 GiB)': both units, so nobody has to guess which one is meant."""
    return f"{nbytes / 1e9:,.2f} GB ({nbytes / 2**30:,.2f} GiB)"


__all__ = [
    "LabAttentionBackend", "check_append_kv", "check_attend_with_cache", "check_in_engine", "check_store_kv",
    "KernelStoreBackend", "print_kernel_run", "time_store_kv", "print_kernel_timing", "require_kernel",
    "DecodeStepper", "FakeStep", "check_kv_step_ratio", "plot_step_times", "print_step_ratio",
    "check_kv_cache_bytes_per_token", "check_kv_cache_bytes", "check_answer_users_on_80gb", "made_up_run",
    "reference_kv_speedup", "users_that_fit",
    "reveal_predictions", "step_flops", "flops_table", "print_kv_toggle_summary", "KVToggleView", "MODEL_SHAPES",
    "KVSizeExplorer", "worked_examples", "print_worked_examples", "print_decode_traffic", "device_memory_bytes",
    "bytes_to_human",
]
