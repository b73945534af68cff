"""Lab 01 helpers: prefill vs decode — checks, figures, the roofline and the explorer widget.

The learner writes four small functions in the notebook (`ttft_tpot_s`, `arithmetic_intensity`,
`roofline_time_s`, `decode_bandwidth_bound_tokens_per_s`), the three numbers of part 3, the
measurement of part 1 (`time_ttft`: a timing harness, warm-up, repeats, median and spread of TTFT per prompt
length, checked on a FakeClock by check_time_ttft; `Prefill` is the real call it times) and one short answer
(the ridge batch of an H100); the check_* functions here test them through `call_learner` and say what is
probably wrong; the figures and the RooflineExplorer plug them in. The experiments (measure_decode,
token_times_from_metrics, measured_points) are written in the notebook itself, where the learner reads them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import ipywidgets as widgets
import plotly.graph_objects as go

from .common import (
    BYTES_PER_PARAM,
    REFERENCE_DEVICES,
    REFERENCE_MODELS,
    CheckFailed,
    as_widget,
    call_learner,
    call_repr,
    expect_number,
    format_seconds,
    format_si,
    is_close,
    new_figure,
    passed,
)

QUICK_PROMPT_LENGTHS = (16, 64, 128, 256)
FULL_PROMPT_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
QUICK_DECODE_TOKENS = 16
FULL_DECODE_TOKENS = 64


# ------------------------------------------------------------------ reference solutions
# The check functions compare against these; the explorer falls back to them while an
# exercise is unfinished. (Reading them is allowed, but write yours first.)
def reference_ttft_tpot_s(arrival_s: float, token_times_s: Sequence[float]) -> tuple[float, float | None]:
    ttft = token_times_s[0] - arrival_s
    if len(token_times_s) < 2:
        return ttft, None
    return ttft, (token_times_s[-1] - token_times_s[0]) / (len(token_times_s) - 1)


def reference_arithmetic_intensity(num_tokens: int, num_params: float, bytes_per_param: float) -> float:
    return 2 * num_params * num_tokens / (num_params * bytes_per_param)


def reference_roofline_time_s(flops: float, bytes_moved: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    return max(flops / peak_flops_per_s, bytes_moved / bandwidth_bytes_per_s)


def reference_decode_bandwidth_bound_tokens_per_s(num_params: float, bytes_per_param: float, bandwidth_bytes_per_s: float) -> float:
    return bandwidth_bytes_per_s / (num_params * bytes_per_param)


# ------------------------------------------------------------------ checks
# Every check calls the learner's code through call_learner: a crash becomes a CheckFailed that names the call.
def _tpot_hint(times: Sequence[float], arrival: float, tpot: float) -> str:
    n = len(times)
    if is_close(tpot, (times[-1] - arrival) / n) or is_close(tpot, (times[-1] - arrival) / (n - 1)):
        return "TPOT leaves the first token out: it averages the decode gaps only (the prefill is TTFT's job)"
    if is_close(tpot, (times[-1] - times[0]) / n):
        return f"{n} tokens have {n - 1} gaps between them: divide by len(token_times_s) - 1"
    return "TPOT = (last token time - first token time) / (number of tokens - 1)"


def _call_ttft_tpot(ttft_tpot_s: Callable, arrival: float, times: Sequence[float], where: str = "") -> tuple:
    name = "ttft_tpot_s"
    args = (arrival, list(times))
    call = call_repr(name, args) + where
    hint = ("" if len(times) > 1 else
            "one token has no gap after it: return None for TPOT when len(token_times_s) < 2")
    result = call_learner(ttft_tpot_s, args, call, hint)
    if not isinstance(result, tuple) or len(result) != 2:
        raise CheckFailed(f"{call} returned {result!r}; expected a tuple (ttft_s, tpot_s)")
    return result


def _expect_ttft(call: str, ttft, arrival: float, times: Sequence[float], want: float) -> None:
    if is_close(ttft, times[0]) and not is_close(ttft, want):
        raise CheckFailed(f"{call} gave ttft_s={float(ttft):.4g}, expected {want:.4g}: "
                          "TTFT is measured from the request's arrival (arrival_s), not from time 0")
    _expect_value(f"{call}[0] (ttft_s)", ttft, want, "TTFT = time of the first token - arrival_s")


def check_ttft_tpot(ttft_tpot_s: Callable) -> None:
    """TTFT = first token time - arrival; TPOT = mean gap between the tokens after the first."""
    name = "ttft_tpot_s"
    cases = [
        (10.0, [10.5, 10.6, 10.7, 10.9]),
        (0.0, [0.25, 0.5]),
        (3.0, [3.2, 3.3, 3.5, 3.6, 4.2, 4.3]),
    ]
    for arrival, times in cases:
        call = call_repr(name, (arrival, times))
        ttft, tpot = _call_ttft_tpot(ttft_tpot_s, arrival, times)
        want_ttft, want_tpot = reference_ttft_tpot_s(arrival, times)
        _expect_ttft(call, ttft, arrival, times, want_ttft)
        if tpot is None:
            raise CheckFailed(f"{call} gave tpot_s=None, expected {want_tpot:.4g}: "
                              "there are several tokens, so there are gaps to average")
        _expect_value(f"{call}[1] (tpot_s)", tpot, want_tpot, _tpot_hint(times, arrival, tpot))
    ttft, tpot = _call_ttft_tpot(ttft_tpot_s, 1.0, [1.5])
    _expect_value(f"{call_repr(name, (1.0, [1.5]))}[0] (ttft_s)", ttft, 0.5,
                  "TTFT = time of the first token - arrival_s")
    if tpot is not None:
        raise CheckFailed(f"{call_repr(name, (1.0, [1.5]))} gave tpot_s={tpot!r}, expected None: one token has no gap "
                          "after it, so TPOT is undefined (the engine reports None too)")
    passed(name, len(cases) + 1)


ENGINE_CLOCK_ARRIVAL_S = 1000.0  # the engine stamps times on a perf_counter clock: far from 0


def check_ttft_tpot_engine(ttft_tpot_s: Callable, metrics) -> None:
    """Your definition against the engine's on a real request (its RequestMetrics): the token times are rebuilt
    from its TTFT and gaps, counted from an arrival at 1000 s (the engine's clock does not start at 0)."""
    name = "ttft_tpot_s"
    arrival = ENGINE_CLOCK_ARRIVAL_S
    times = [arrival + metrics.ttft_s]
    for gap in metrics.itl_s:
        times.append(times[-1] + gap)
    where = f" (the request measured in part 1: {len(times)} tokens, arrival at {arrival:g} s)"
    call = call_repr(name, (arrival, times)) + where
    ttft, tpot = _call_ttft_tpot(ttft_tpot_s, arrival, times, where)
    _expect_ttft(call, ttft, arrival, times, metrics.ttft_s)
    if metrics.tpot_s is None:
        if tpot is not None:
            raise CheckFailed(f"{call} gave tpot_s={tpot!r}, expected None: one token has no gap after it")
    else:
        if tpot is None:
            raise CheckFailed(f"{call} gave tpot_s=None, expected the engine's {metrics.tpot_s:.4g}")
        _expect_value(f"{call}[1] (tpot_s)", tpot, metrics.tpot_s, _tpot_hint(times, arrival, tpot))
    passed(f"{name} on the engine's request", 1)


def _intensity_hint(got, tokens: float, params: float, bpp: float) -> str:
    want = reference_arithmetic_intensity(tokens, params, bpp)
    if is_close(got, want / 2):
        return "each weight does a multiply AND an add per token: 2 FLOPs per parameter per token"
    if is_close(got, 2 * params * tokens) or is_close(got, 2 * params * tokens * bpp):
        return "that is the FLOP count; intensity divides it by the bytes read (num_params * bytes_per_param)"
    if is_close(got, 2 * tokens * bpp):
        return "divide by bytes_per_param: fewer bytes per weight means more FLOPs per byte"
    if is_close(got, 2 / bpp) and tokens != 1:
        return "the weights are read once per step however many tokens it carries, so intensity grows with num_tokens"
    return "intensity = FLOPs / bytes = (2 * num_params * num_tokens) / (num_params * bytes_per_param)"


def _check_intensity_cases(arithmetic_intensity: Callable, cases: Sequence[tuple]) -> None:
    name = "arithmetic_intensity"
    for args in cases:
        got = call_learner(arithmetic_intensity, args, name=name)
        expect_number(name, args, got, reference_arithmetic_intensity(*args), _intensity_hint(got, *args))


def check_arithmetic_intensity(arithmetic_intensity: Callable) -> None:
    """FLOPs per byte of weights read: 2 * params * tokens / (params * bytes_per_param)."""
    cases = [(1, 7e9, 2), (1, 134.5e6, 4), (512, 7e9, 2), (64, 1e9, 0.5), (3, 2e9, 1)]
    _check_intensity_cases(arithmetic_intensity, cases)
    passed("arithmetic_intensity", len(cases))


def check_arithmetic_intensity_more(arithmetic_intensity: Callable) -> None:
    """The course's numbers (decode in fp16 and fp32, long prefills, int4), and two laws: doubling the tokens
    per weight read doubles the intensity; the model's size cancels out."""
    name = "arithmetic_intensity"
    cases = [(1, 6.74e9, 2), (1, 135e6, 4), (2048, 1e9, 2), (7, 3e9, 0.5)]
    _check_intensity_cases(arithmetic_intensity, cases)
    one, two = (32, 8e9, 2), (64, 8e9, 2)
    a, b = (call_learner(arithmetic_intensity, args, name=name) for args in (one, two))
    if not is_close(b, 2 * a):
        raise CheckFailed(f"{call_repr(name, two)} = {b!r} is not twice {call_repr(name, one)} = {a!r}: one weight "
                          "read serves every token of the step, so twice the tokens is twice the FLOPs per byte")
    small, big = (16, 1e8, 2), (16, 7e10, 2)
    a, b = (call_learner(arithmetic_intensity, args, name=name) for args in (small, big))
    if not is_close(a, b):
        raise CheckFailed(f"{call_repr(name, small)} = {a!r} but {call_repr(name, big)} = {b!r}: num_params is in the "
                          "FLOPs and in the bytes, so it cancels; the intensity depends on tokens and bytes per weight")
    passed(name, len(cases) + 2)


def _roofline_hint(got, flops: float, nbytes: float, peak: float, bw: float) -> str:
    compute, memory = flops / peak, nbytes / bw
    if is_close(got, min(compute, memory)) and not is_close(compute, memory):
        return "the step cannot finish before its slowest part: use max, not min"
    if is_close(got, compute + memory):
        return ("compute and memory traffic overlap (the roofline assumes perfect overlap), so the time is "
                "the max of the two, not their sum")
    if is_close(got, flops / bw) or is_close(got, nbytes / peak) or is_close(got, max(flops / bw, nbytes / peak)):
        return "FLOPs go with peak FLOP/s and bytes go with bandwidth (bytes/s)"
    return "time = max(flops / peak_flops_per_s, bytes_moved / bandwidth_bytes_per_s)"


def _check_roofline_cases(roofline_time_s: Callable, cases: Sequence[tuple]) -> None:
    name = "roofline_time_s"
    for args in cases:
        got = call_learner(roofline_time_s, args, name=name)
        expect_number(name, args, got, reference_roofline_time_s(*args), _roofline_hint(got, *args))


def check_roofline_time(roofline_time_s: Callable) -> None:
    """A step takes as long as the slower of its compute (flops / peak) and its memory traffic."""
    cases = [
        (2e12, 1e9, 1e15, 1e12),         # compute-bound: 2 ms of math vs 1 ms of memory
        (2.7e8, 5.4e8, 6.7e10, 1.7e10),  # SmolLM2 decode on a CPU: memory-bound
        (1e15, 1e9, 1e15, 3.35e12),      # compute-bound
        (1e9, 1e9, 1e9, 1e9),            # exactly at the ridge
    ]
    _check_roofline_cases(roofline_time_s, cases)
    passed("roofline_time_s", len(cases))


def check_roofline_time_more(roofline_time_s: Callable) -> None:
    """More steps: Llama-2-7B decode on an H100 (memory-bound), a compute-bound prefill, a step with no FLOPs,
    and the ridge itself (both times equal: the time is that value)."""
    cases = [
        (2 * 6.74e9, 2 * 6.74e9, 989e12, 3.35e12),  # Llama-2-7B bf16 decode at batch 1 on an H100
        (3e12, 2e12, 1e12, 1e12),                   # compute-bound
        (0, 5e8, 1e12, 1e10),                       # no FLOPs: memory alone
        (2e12, 2e9, 1e12, 1e9),                     # at the ridge: 2 s either way
    ]
    _check_roofline_cases(roofline_time_s, cases)
    passed("roofline_time_s", len(cases))


def _bound_hint(got, params: float, bpp: float, bw: float) -> str:
    if is_close(got, bw / params):
        return "a decode step reads every weight once — did you forget bytes_per_param?"
    if is_close(got, params * bpp / bw):
        return "that is seconds per token (bytes / bandwidth); tokens per second is its inverse"
    if is_close(got, bw * bpp / params):
        return "weights take num_params * bytes_per_param bytes: multiply by bytes_per_param, don't divide"
    if is_close(got, bw / (2 * params)) or is_close(got, bw / (2 * params * bpp)):
        return "count bytes, not FLOPs: one decode step moves num_params * bytes_per_param bytes"
    return "tokens/s = bandwidth_bytes_per_s / (num_params * bytes_per_param)"


def _check_bound_cases(fn: Callable, cases: Sequence[tuple]) -> None:
    name = "decode_bandwidth_bound_tokens_per_s"
    for args in cases:
        got = call_learner(fn, args, name=name)
        expect_number(name, args, got, reference_decode_bandwidth_bound_tokens_per_s(*args), _bound_hint(got, *args))


def check_decode_bandwidth_bound(decode_bandwidth_bound_tokens_per_s: Callable) -> None:
    """Batch-1 decode reads every weight once per token: tokens/s <= bandwidth / weight bytes."""
    cases = [(7e9, 2, 1e12), (6.74e9, 2, 3.35e12), (134.5e6, 4, 16.8e9), (70e9, 0.5, 2e12)]
    _check_bound_cases(decode_bandwidth_bound_tokens_per_s, cases)
    passed("decode_bandwidth_bound_tokens_per_s", len(cases))


def check_decode_bandwidth_bound_more(decode_bandwidth_bound_tokens_per_s: Callable) -> None:
    """More models and devices (Llama-3.1-8B in int4 on an H200, SmolLM2 in fp32 at 50 GB/s, 1e9 one-byte weights
    at 1 GB/s), and the law behind quantization: halving the bytes per weight doubles the bound."""
    name = "decode_bandwidth_bound_tokens_per_s"
    cases = [(8.03e9, 0.5, 4.8e12), (135e6, 4, 50e9), (1e9, 1, 1e9)]
    _check_bound_cases(decode_bandwidth_bound_tokens_per_s, cases)
    fp16, fp8 = (7e9, 2, 2e12), (7e9, 1, 2e12)
    a, b = (call_learner(decode_bandwidth_bound_tokens_per_s, args, name=name) for args in (fp16, fp8))
    if not is_close(b, 2 * a):
        raise CheckFailed(f"{call_repr(name, fp8)} = {b!r} is not twice {call_repr(name, fp16)} = {a!r}: half the "
                          "bytes per weight is half the bytes read per token, so twice the tokens per second")
    passed(name, len(cases) + 1)


def _expect_value(name: str, actual, expected: float, hint: str = "", rel: float = 1e-6) -> None:
    """Raise CheckFailed with 'name = A, expected E: hint' unless the value `actual` is a number ≈ expected."""
    if isinstance(actual, bool) or not isinstance(actual, (int, float)) and not hasattr(actual, "__float__"):
        raise CheckFailed(f"{name} is {actual!r} ({type(actual).__name__}); expected a number, {expected:.4g}")
    if not is_close(actual, expected, rel=rel):
        raise CheckFailed(f"{name} = {float(actual):.4g}, expected {expected:.4g}" + (f": {hint}" if hint else ""))


H100 = "NVIDIA H100 SXM (bf16)"
LLAMA2_7B = "Llama-2-7B"


def check_apply_bounds(llama2_7b_h100_tokens_per_s, engine_bound_tokens_per_s, fraction_of_bound, *,
                       num_params: float, bytes_per_param: float, bandwidth_bytes_per_s: float,
                       decode_tokens_per_s: float) -> None:
    """The three numbers of part 3: Llama-2-7B fp16 on an H100, this engine's model on this device at the
    measured bandwidth, and the measured decode speed as a fraction (not a percentage) of that bound."""
    h100_peak, h100_bw = REFERENCE_DEVICES[H100]
    params = REFERENCE_MODELS[LLAMA2_7B]
    got, want = llama2_7b_h100_tokens_per_s, h100_bw / (params * 2)
    hint = (f"use the exact count, {params:.3g} parameters" if is_close(got, h100_bw / (7e9 * 2), rel=1e-3) else
            "fp16 is 2 bytes per parameter" if is_close(got, h100_bw / params) or is_close(got, h100_bw / (params * 4))
            else "FLOP/s do not enter the bound: the H100's bandwidth is 3.35e12 B/s"
            if is_close(got, h100_peak / (params * 2), rel=1e-3) else _bound_hint(got, params, 2, h100_bw)
            if isinstance(got, (int, float)) else "")
    _expect_value("llama2_7b_h100_tokens_per_s (Llama-2-7B, 6.74e9 parameters, fp16, on an H100 at 3.35 TB/s)",
                  got, want, hint, rel=1e-3)
    got, want = engine_bound_tokens_per_s, bandwidth_bytes_per_s / (num_params * bytes_per_param)
    hint = ""
    if isinstance(got, (int, float)):
        if bytes_per_param != 2 and is_close(got, bandwidth_bytes_per_s / (num_params * 2), rel=1e-3):
            hint = (f"this engine's weights are {bytes_per_param:g} bytes each here (BYTES_PER_PARAM), not 2: "
                    "fp32 on a CPU, bf16 on a GPU")
        elif is_close(got, h100_bw / (num_params * bytes_per_param), rel=1e-3):
            hint = "this device's measured `bandwidth`, not the H100's"
        else:
            hint = _bound_hint(got, num_params, bytes_per_param, bandwidth_bytes_per_s)
    _expect_value(f"engine_bound_tokens_per_s (NUM_PARAMS={num_params:.4g}, BYTES_PER_PARAM={bytes_per_param:g}, "
                  f"bandwidth={bandwidth_bytes_per_s:.4g} B/s)", got, want, hint, rel=1e-3)
    got, want = fraction_of_bound, decode_tokens_per_s / want
    hint = ""
    if isinstance(got, (int, float)):
        if is_close(got, 1 / want, rel=1e-3):
            hint = "the wrong way round: a fraction of the bound is measured tokens/s / bound tokens/s"
        elif is_close(got, 100 * want, rel=1e-3):
            hint = "a fraction, not a percentage (0.25, not 25)"
        else:
            hint = 'fraction_of_bound = decode["tokens_per_s"] / engine_bound_tokens_per_s'
    _expect_value(f"fraction_of_bound (measured decode {decode_tokens_per_s:.4g} tokens/s)", got, want, hint, rel=1e-3)
    passed("the three numbers of part 3", 3)


# --- Part 1, measure: the learner's TTFT harness, graded on a fake clock ---------------------------------------
# The course's reference run, on the machine the course was written on: the notebook's measurement cell in full mode
# (MINILLM_QUICK unset: FULL_PROMPT_LENGTHS, 1 warm-up and 3 timed prefills per length, SmolLM2-135M in fp32), i.e.
# time_ttft(Prefill(LLM()), FULL_PROMPT_LENGTHS, warmup=1, repeats=3). The machine was shared with several other
# jobs while it ran (load ~12 on its 2 cores), so every time is several times slower than an idle run; the ratio,
# a quotient of two times taken under the same load, is what to compare.
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
REFERENCE_TTFT_S = {16: 1.84, 2048: 108.7}   # median TTFT at the shortest and the longest prompt (shared machine)
REFERENCE_TTFT_RATIO = 59.2                   # TTFT(2048) / TTFT(16)


class Prefill:
    """Each call ``prefill(num_tokens)`` sends one request of exactly `num_tokens` prompt tokens (plain English) to
    `llm` and returns once its first token exists: one prefill, what TTFT measures. The prompts are built once per
    length, outside any timing."""

    def __init__(self, llm):
        from .. import SamplingParams
        from .common import prompt_token_ids

        self.llm = llm
        self.params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self._prompt = lambda n: prompt_token_ids(llm.tokenizer, n)
        self._ids: dict[int, list[int]] = {}
        self.calls = 0

    def __call__(self, num_tokens: int) -> None:
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"prefill(num_tokens={num_tokens!r}): a whole number of prompt tokens, >= 1")
        ids = self._ids.get(num_tokens)
        if ids is None:
            ids = self._ids[num_tokens] = self._prompt(num_tokens)
        self.llm.generate([{"prompt_token_ids": ids}], self.params)
        self.calls += 1


class FakePrefill:
    """A stand-in for Prefill in the check: ``prefill(n)`` moves `clock` by the next scripted cost of length n."""

    def __init__(self, clock, costs: dict[int, Sequence[float]]):
        self.clock, self.costs = clock, {n: list(c) for n, c in costs.items()}
        self.calls = {n: 0 for n in costs}

    def __call__(self, num_tokens) -> None:
        if num_tokens not in self.costs:
            raise ValueError(f"prefill({num_tokens!r}): this check measures only prompt lengths {sorted(self.costs)}")
        costs = self.costs[num_tokens]
        self.clock.advance(costs[min(self.calls[num_tokens], len(costs) - 1)])
        self.calls[num_tokens] += 1

    def __repr__(self) -> str:
        return "<fake prefill>"


TTFT_TIMING_CASES = (  # (the case in words, prompt lengths in the order given, warmup, repeats, seed)
    ("lengths 16, 64, 256; 1 warm-up and 5 timed prefills each", (16, 64, 256), 1, 5, 1),
    ("lengths given out of order (128, 16, 512, 32): the ratio is longest over shortest, not last over first",
     (128, 16, 512, 32), 2, 4, 2),
    ("no warm-up, 3 timed prefills, two lengths", (8, 1024), 0, 3, 3),
)


def _fake_ttft_costs(lengths: Sequence[int], warmup: int, repeats: int, seed: int) -> dict[int, list[float]]:
    """Scripted prefill costs: a fixed 20 ms plus 0.4 ms per prompt token, per length (warm-up 20x, one 4x outlier)."""
    from .common import scripted_costs

    return {n: scripted_costs(0.02 + 0.0004 * n, warmup, repeats, seed + i) for i, n in enumerate(lengths)}


def check_time_ttft(time_ttft: Callable, cases=TTFT_TIMING_CASES) -> None:
    """time_ttft(prefill, prompt_lengths, clock, warmup, repeats) on a fake prefill whose calls move a FakeClock by
    known costs (warm-up calls 20x slower, one timed call 4x): per length, warmup + repeats calls, the warm-up
    dropped, the median, min and max of the timed ones; the ratio is the median at the longest prompt over the
    median at the shortest."""
    from .common import FakeClock, timing_mistake, timing_summary

    for name, lengths, warmup, repeats, seed in cases:
        clock = FakeClock()
        costs = _fake_ttft_costs(lengths, warmup, repeats, seed)
        prefill = FakePrefill(clock, costs)
        call = f"time_ttft(<fake prefill>, {list(lengths)}, clock=FakeClock(), warmup={warmup}, repeats={repeats}). Case: {name}"
        got = call_learner(time_ttft, (prefill, list(lengths), clock, warmup, repeats), call)
        if clock.reads == 0:
            raise CheckFailed(f"{call}: your code never read `clock`: time with the clock you are given "
                              "(start = clock() ... clock() - start), not time.perf_counter, so the check can "
                              "script what each prefill costs")
        for n in lengths:
            if prefill.calls[n] != warmup + repeats:
                raise CheckFailed(f"{call}: prefill({n}) was called {prefill.calls[n]} times; expected warmup + repeats "
                                  f"= {warmup + repeats} for every length")
        if not isinstance(got, dict) or not {"rows", "ratio"} <= set(got) or not isinstance(got["rows"], (list, tuple)):
            raise CheckFailed(f"{call} returned {got!r}; return a dict {{'rows': [one dict per length], 'ratio': ...}}")
        rows = got["rows"]
        if [r.get("prompt_tokens") if isinstance(r, dict) else r for r in rows] != list(lengths):
            raise CheckFailed(f"{call}: rows have prompt_tokens "
                              f"{[r.get('prompt_tokens') if isinstance(r, dict) else r for r in rows]}; expected one "
                              f"row per length, in the order given: {list(lengths)}")
        for row in rows:
            n = row["prompt_tokens"]
            want = timing_summary(costs[n][warmup:])
            for key in ("median", "min", "max"):
                value = row.get(key)
                if is_close(value, want[key]):
                    continue
                why = timing_mistake(value, costs[n], warmup) if key == "median" else ""
                if key != "median" and is_close(value, (min if key == "min" else max)(costs[n])):
                    why = "the spread kept a warm-up call: take min and max of the timed calls only"
                shown = f"{float(value):.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
                raise CheckFailed(f"{call}: the row of {n} tokens has {key} = {shown}, expected {want[key]:.6g} s"
                                  + (f": that is {why}" if why else ""))
        medians = {r["prompt_tokens"]: r["median"] for r in rows}
        want_ratio = medians[max(lengths)] / medians[min(lengths)]
        ratio = got["ratio"]
        if not is_close(ratio, want_ratio):
            hint = "the median TTFT at the longest prompt over the median at the shortest"
            if is_close(ratio, 1 / want_ratio):
                hint = "it is upside down: the longest prompt's TTFT over the shortest's (above 1)"
            elif is_close(ratio, medians[lengths[-1]] / medians[lengths[0]]):
                hint = "that is the last row over the first: pick the longest and the shortest prompt by their length"
            elif is_close(ratio, max(lengths) / min(lengths)):
                hint = "that is the ratio of the prompt lengths; divide the measured TTFTs"
            raise CheckFailed(f"{call}: ratio = {ratio!r}, expected {want_ratio:.6g}: {hint}")
    passed("time_ttft", len(cases))


def ttft_rows_from_timing(timing: dict) -> list[dict]:
    """Your harness's rows as the rows the figures read: prompt_tokens, ttft_s (the median), min_s, max_s and the
    prompt tokens per second of the median."""
    return [{"prompt_tokens": r["prompt_tokens"], "ttft_s": r["median"], "min_s": r["min"], "max_s": r["max"],
             "prefill_tokens_per_s": r["prompt_tokens"] / r["median"]} for r in timing["rows"]]


def print_ttft_timing(timing: dict) -> None:
    """Your rows, then your ratio beside the course's reference run."""
    from .common import print_beside_reference

    rows = timing["rows"]
    for r in rows:
        print(f"{r['prompt_tokens']:5d} prompt tokens: TTFT {format_seconds(r['median'])} (min "
              f"{format_seconds(r['min'])}, max {format_seconds(r['max'])}) = {r['prompt_tokens'] / r['median']:,.0f} "
              "prompt tokens/s")
    lengths = [r["prompt_tokens"] for r in rows]
    print_beside_reference(f"TTFT({max(lengths)}) / TTFT({min(lengths)})", timing["ratio"], REFERENCE_TTFT_RATIO,
                           f"{REFERENCE_HARDWARE}, TTFT(2048) / TTFT(16)", unit="x")


def ridge_batch(peak_flops_per_s: float, bandwidth_bytes_per_s: float, num_params: float, bytes_per_param: float,
                arithmetic_intensity: Callable = reference_arithmetic_intensity) -> int:
    """The smallest whole decode batch B that is compute-bound: B * intensity(batch 1) >= peak / bandwidth
    (at equality, compute-bound: the roofline's tie)."""
    ridge = peak_flops_per_s / bandwidth_bytes_per_s
    per_request = arithmetic_intensity(1, num_params, bytes_per_param)
    return max(1, math.ceil(ridge / per_request * (1 - 1e-12)))


def check_answer_ridge_batch_h100(answer) -> None:
    """The smallest whole decode batch at which Llama-2-7B in bf16 is compute-bound on an H100 SXM."""
    peak, bw = REFERENCE_DEVICES[H100]
    params = REFERENCE_MODELS[LLAMA2_7B]
    ridge = peak / bw
    want = ridge_batch(peak, bw, params, 2)
    name = f"answer_ridge_batch_h100 (Llama-2-7B bf16 on an H100: ridge {ridge:.4g} FLOP/byte)"
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) and not hasattr(answer, "__float__"):
        raise CheckFailed(f"{name} is {answer!r} ({type(answer).__name__}); expected a whole number of requests")
    value = float(answer)
    if value == want:
        passed("answer_ridge_batch_h100", 1)
        return
    if not value.is_integer():
        hint = ("a batch is a whole number of requests: the smallest whole B whose intensity reaches the ridge "
                "(round up, math.ceil)") if is_close(value, ridge, rel=1e-3) else ""
    elif value == want - 1:
        hint = (f"rounded down: at B={want - 1} the intensity is {want - 1} FLOP/byte, still below the ridge "
                f"{ridge:.4g}, so the step is memory-bound; round up")
    elif is_close(value, math.ceil(ridge / 0.5)) or is_close(value, math.floor(ridge / 0.5)):
        hint = "bf16 is 2 bytes per weight: a batch-1 decode does 2 FLOPs per 2 bytes, 1 FLOP/byte (0.5 is fp32)"
    elif is_close(value, math.ceil(ridge / 2)) or is_close(value, math.floor(ridge / 2)):
        hint = "2 FLOPs per weight per request, but 2 bytes per weight in bf16: the batch-1 intensity is 1 FLOP/byte"
    elif value <= 1:
        hint = "at batch 1 decode is deep in the memory-bound region (1 FLOP/byte against a ridge near 295)"
    else:
        hint = ("B = ceil((peak / bandwidth) / arithmetic_intensity(1, 6.74e9, 2)) with the H100's 989e12 FLOP/s "
                "and 3.35e12 B/s")
    raise CheckFailed(f"{name} = {answer!r}, expected {want}" + (f": {hint}" if hint else ""))


# ------------------------------------------------------------------ figures
def ttft_figure(rows: Sequence[dict], device: str) -> go.Figure:
    """TTFT vs prompt length, with the line TTFT would follow if it grew in proportion to the
    prompt from the shortest one measured."""
    fig = new_figure("Time to first token vs prompt length", "prompt tokens", "TTFT (ms)", device=device)
    xs = [r["prompt_tokens"] for r in rows]
    ys = [r["ttft_s"] * 1e3 for r in rows]
    spread = None
    if rows and all("min_s" in r and "max_s" in r for r in rows):
        spread = dict(type="data", symmetric=False, array=[r["max_s"] * 1e3 - y for r, y in zip(rows, ys)],
                      arrayminus=[y - r["min_s"] * 1e3 for r, y in zip(rows, ys)])
    fig.add_scatter(
        x=xs, y=ys, mode="lines+markers", name="measured TTFT (median; bars: min to max)" if spread else "measured TTFT",
        error_y=spread,
        customdata=[r["prefill_tokens_per_s"] for r in rows],
        hovertemplate="%{x} tokens: %{y:.1f} ms (%{customdata:.0f} prompt tokens/s)<extra></extra>",
    )
    if rows:
        per_token_ms = ys[0] / xs[0]
        fig.add_scatter(x=xs, y=[per_token_ms * x for x in xs], mode="lines", name="proportional to the shortest",
                        line=dict(dash="dot", color="gray"))
    return fig


def decode_steps_figure(decode: dict, device: str) -> go.Figure:
    """One bar per decode step (inter-token latency), and the TPOT line."""
    itl_ms = [s * 1e3 for s in decode["itl_s"]]
    fig = new_figure(f"Decode: one token per step ({decode['tokens_per_s']:.1f} tokens/s)", "output token",
                     "time for this token (ms)", device=device, height=360)
    fig.add_bar(x=list(range(2, len(itl_ms) + 2)), y=itl_ms, name="inter-token latency")
    fig.add_scatter(x=[1.5, len(itl_ms) + 1.5], y=[decode["tpot_s"] * 1e3] * 2, mode="lines",
                    name=f"TPOT {decode['tpot_s'] * 1e3:.1f} ms", line=dict(color="firebrick"))
    return fig


def _roof(peak_flops_per_s: float, bandwidth_bytes_per_s: float, intensities: Sequence[float]) -> list[float]:
    return [min(peak_flops_per_s, ai * bandwidth_bytes_per_s) for ai in intensities]


ROOF_INTENSITIES = [2 ** (k / 4) for k in range(-16, 61)]  # 1/16 .. 32768 FLOP/byte


def roofline_figure(peak_flops_per_s: float, bandwidth_bytes_per_s: float, device: str,
                    points: Sequence[dict] = (), widget: bool = False) -> go.Figure:
    """Log-log roofline: attainable FLOP/s = min(peak, intensity * bandwidth), and points
    {name, intensity, flops_per_s} on it."""
    ridge = peak_flops_per_s / bandwidth_bytes_per_s
    fig = new_figure(
        f"Roofline: peak {format_si(peak_flops_per_s, 'FLOP/s')}, bandwidth {format_si(bandwidth_bytes_per_s, 'B/s')}, "
        f"ridge at {ridge:.3g} FLOP/byte",
        "arithmetic intensity (FLOPs per byte of weights read)", "FLOP/s", device=device,
        height=460, log_x=True, log_y=True,
    )
    # The area under the roof's right end stays empty: the legend goes there.
    fig.update_layout(legend=dict(x=0.99, xanchor="right", y=0.02, yanchor="bottom", bgcolor="rgba(255,255,255,0.85)"))
    fig.add_scatter(x=ROOF_INTENSITIES, y=_roof(peak_flops_per_s, bandwidth_bytes_per_s, ROOF_INTENSITIES),
                    mode="lines", name="roof: min(peak, intensity × bandwidth)", line=dict(color="black", width=3))
    groups: dict[str, list[dict]] = {}
    for point in points:
        groups.setdefault(point.get("group", point["name"]), []).append(point)
    for group, members in groups.items():
        fig.add_scatter(x=[p["intensity"] for p in members], y=[p["flops_per_s"] for p in members],
                        mode="markers+text", name=group, text=[p.get("label", p["name"]) for p in members],
                        textposition="top center", marker=dict(size=12, symbol=members[0].get("symbol", "circle")),
                        hovertemplate="%{text}: %{x:.3g} FLOP/B, %{y:.3g} FLOP/s<extra></extra>")
    return as_widget(fig) if widget else fig


def bound_figure(measured_tokens_per_s: float, bound_tokens_per_s: float, device: str) -> go.Figure:
    """Measured batch-1 decode tokens/s next to the bandwidth bound."""
    fraction = measured_tokens_per_s / bound_tokens_per_s
    fig = new_figure(f"Decode at batch 1 reaches {fraction:.0%} of the bandwidth bound", "", "tokens/s",
                     device=device, height=340)
    fig.add_bar(x=["bandwidth bound", "measured (minillm)"], y=[bound_tokens_per_s, measured_tokens_per_s],
                text=[f"{bound_tokens_per_s:.1f}", f"{measured_tokens_per_s:.1f}"], textposition="auto",
                marker_color=["lightgray", "steelblue"], showlegend=False)
    return fig


# ------------------------------------------------------------------ the explorer
def learner_or_reference(fn: Callable | None, reference: Callable, probe: tuple, name: str) -> tuple[Callable, str]:
    """The learner's function if it runs; the reference (and a note saying so) while it raises
    NotImplementedError."""
    if fn is None:
        return reference, ""
    try:
        fn(*probe)
    except NotImplementedError:
        return reference, f"<i>{name} is not written yet: the reference is used.</i> "
    return fn, ""


class RooflineExplorer:
    """Sliders and dropdowns over a roofline FigureWidget.

    - `batch_slider`: requests decoded together; one weight read serves all of them.
    - `prompt_slider`: prompt tokens in one prefill step.
    - `device_dropdown`, `model_dropdown`, `dtype_dropdown`: the roof and the weight bytes.

    Each callback recomputes the two operating points (decode, prefill) with the learner's
    `arithmetic_intensity` and `roofline_time_s`, moves them on `figure` and rewrites `readout`.
    """

    def __init__(
        self,
        devices: dict[str, tuple[float, float]],
        models: dict[str, float] | None = None,
        dtypes: dict[str, float] | None = None,
        arithmetic_intensity: Callable | None = None,
        roofline_time_s: Callable | None = None,
        device: str | None = None,
        model: str | None = None,
        dtype: str | None = None,
        measured_points: dict[str, Sequence[dict]] | None = None,
    ):
        self.devices = dict(devices)
        self.models = dict(models or REFERENCE_MODELS)
        self.dtypes = dict(dtypes or BYTES_PER_PARAM)
        self.measured_points = dict(measured_points or {})
        self.arithmetic_intensity, note_ai = learner_or_reference(
            arithmetic_intensity, reference_arithmetic_intensity, (1, 1e9, 2), "arithmetic_intensity (exercise 3)")
        self.roofline_time_s, note_rt = learner_or_reference(
            roofline_time_s, reference_roofline_time_s, (1e9, 1e9, 1e12, 1e12), "roofline_time_s (exercise 4)")
        self.note = note_ai + note_rt

        self.batch_slider = widgets.IntSlider(value=1, min=1, max=256, step=1, description="decode batch",
                                              continuous_update=True, style={"description_width": "110px"},
                                              layout=widgets.Layout(width="520px"))
        self.prompt_slider = widgets.SelectionSlider(options=[2 ** k for k in range(4, 14)], value=256,
                                                     description="prompt tokens", style={"description_width": "110px"},
                                                     layout=widgets.Layout(width="520px"))
        self.device_dropdown = widgets.Dropdown(options=list(self.devices), value=device or next(iter(self.devices)),
                                                description="device", layout=widgets.Layout(width="520px"))
        self.model_dropdown = widgets.Dropdown(options=list(self.models), value=model or next(iter(self.models)),
                                               description="model", layout=widgets.Layout(width="320px"))
        self.dtype_dropdown = widgets.Dropdown(options=list(self.dtypes), value=dtype or next(iter(self.dtypes)),
                                               description="weights", layout=widgets.Layout(width="220px"))
        self.readout = widgets.HTML()

        figure = roofline_figure(1.0, 1.0, "")  # real numbers arrive in update()
        marker = dict(size=14, line=dict(width=1, color="black"))
        figure.add_scatter(x=[1], y=[1], mode="markers+text", name="decode (batch B)", textposition="top left",
                           marker=dict(color="firebrick", **marker))
        figure.add_scatter(x=[1], y=[1], mode="markers+text", name="prefill (T prompt tokens)",
                           textposition="bottom right", marker=dict(color="royalblue", symbol="diamond", **marker))
        figure.add_scatter(x=[], y=[], mode="markers+text", name="measured on this device",
                           textposition="bottom center", marker=dict(color="gray", symbol="x", size=11))
        self.figure = figure

        for control in (self.batch_slider, self.prompt_slider, self.device_dropdown, self.model_dropdown, self.dtype_dropdown):
            control.observe(self.update, names="value")
        self.update()  # fills the plain figure; the widget is born with the right data
        self.figure = as_widget(figure)
        self.widget = widgets.VBox([
            self.batch_slider, self.prompt_slider, self.device_dropdown,
            widgets.HBox([self.model_dropdown, self.dtype_dropdown]), self.figure, self.readout,
        ])

    # the numbers behind one operating point
    def operating_point(self, num_tokens: int) -> dict:
        peak, bandwidth = self.devices[self.device_dropdown.value]
        num_params = self.models[self.model_dropdown.value]
        bytes_per_param = self.dtypes[self.dtype_dropdown.value]
        flops = 2 * num_params * num_tokens
        bytes_moved = num_params * bytes_per_param
        seconds = self.roofline_time_s(flops, bytes_moved, peak, bandwidth)
        return {
            "num_tokens": num_tokens,
            "intensity": self.arithmetic_intensity(num_tokens, num_params, bytes_per_param),
            "seconds": seconds,
            "flops_per_s": flops / seconds,
            "tokens_per_s": num_tokens / seconds,
            "bound": "compute-bound" if flops / peak >= bytes_moved / bandwidth else "memory-bound",
        }

    def update(self, change=None) -> None:
        peak, bandwidth = self.devices[self.device_dropdown.value]
        decode = self.operating_point(self.batch_slider.value)
        prefill = self.operating_point(self.prompt_slider.value)
        ridge = peak / bandwidth
        measured = self.measured_points.get(self.device_dropdown.value, ())
        # One update per trace, no batch_update(): a batched restyle that sets x on some traces
        # and not on others sends x=undefined for the rest, and plotly.js then drops their x.
        fig = self.figure
        fig.layout.title.text = f"{self.model_dropdown.value} ({self.dtype_dropdown.value}) — ridge at {ridge:.3g} FLOP/byte"
        fig.layout.title.subtitle.text = (f"{self.device_dropdown.value}: peak {format_si(peak, 'FLOP/s')}, "
                                          f"bandwidth {format_si(bandwidth, 'B/s')}")
        fig.data[0].update(x=ROOF_INTENSITIES, y=_roof(peak, bandwidth, ROOF_INTENSITIES))
        fig.data[1].update(x=[decode["intensity"]], y=[decode["flops_per_s"]], text=[f"decode B={decode['num_tokens']}"])
        fig.data[2].update(x=[prefill["intensity"]], y=[prefill["flops_per_s"]], text=[f"prefill T={prefill['num_tokens']}"])
        fig.data[3].update(x=[p["intensity"] for p in measured], y=[p["flops_per_s"] for p in measured],
                           text=[p.get("label", p["name"]) for p in measured])
        self.readout.value = self.note + (
            "<table style='border-collapse:collapse'>"
            "<tr><th style='text-align:left;padding-right:14px'></th><th style='padding-right:14px'>intensity</th>"
            "<th style='padding-right:14px'>time per step</th><th style='padding-right:14px'>tokens/s</th><th>limited by</th></tr>"
            f"<tr><td style='padding-right:14px'>decode, batch {decode['num_tokens']}</td>"
            f"<td>{decode['intensity']:.3g} FLOP/B</td><td>{format_seconds(decode['seconds'])}</td>"
            f"<td>{decode['tokens_per_s']:.4g} ({decode['tokens_per_s'] / decode['num_tokens']:.4g} per request)</td>"
            f"<td>{decode['bound']}</td></tr>"
            f"<tr><td style='padding-right:14px'>prefill, {prefill['num_tokens']} tokens</td>"
            f"<td>{prefill['intensity']:.3g} FLOP/B</td><td>{format_seconds(prefill['seconds'])} (= TTFT bound)</td>"
            f"<td>{prefill['tokens_per_s']:.4g}</td><td>{prefill['bound']}</td></tr></table>"
            f"<p>Decode becomes compute-bound at a batch of about {self.ridge_batch():.1f}: "
            f"from B = {math.ceil(self.ridge_batch() * (1 - 1e-12))} on.</p>"
        )

    def ridge_batch(self) -> float:
        """The decode batch at which the intensity reaches the ridge point (peak / bandwidth)."""
        peak, bandwidth = self.devices[self.device_dropdown.value]
        per_token = self.arithmetic_intensity(1, self.models[self.model_dropdown.value], self.dtypes[self.dtype_dropdown.value])
        return (peak / bandwidth) / per_token if per_token > 0 else math.inf


def devices_with_this_one(peak_flops_per_s: float, bandwidth_bytes_per_s: float, device: str) -> dict[str, tuple[float, float]]:
    """This device's measured numbers first, then the reference accelerators."""
    return {f"this device, measured ({device})": (peak_flops_per_s, bandwidth_bytes_per_s), **REFERENCE_DEVICES}
