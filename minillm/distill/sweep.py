"""The smallest model that meets the bar: a sweep over student depth x weight_dtype, the teacher included as a point.

    points = run_sweep({"teacher": teacher_dir, "student 6": "students/extract-6", ...}, task="extract")
    front = pareto_front(points)                      # cheapest first; no other point is cheaper and better
    pick = pick_point(points, teacher_score, 0.05)    # the cheapest point within 0.05 of the teacher, or None
    print(format_sweep(points, front, pick, ...)); sweep_figure(points, front, pick, ...).write_html("pareto.html")

Each point is one model loaded with one weight_dtype (fp32: the model dtype; int8 / int4: minillm/quant).
It is scored on the held-out messages (its own prompt: the teacher's few-shot one, the students' short one)
and timed through `repeat_median`: warm-up requests discarded, then `repeats` batch-1 greedy requests of
`decode_tokens` tokens on a task prompt, the median kept (min and max beside it). Decode tokens/s is
1 / TPOT, TTFT the engine's (arrival to first token, the prompt's prefill included), resident memory the
weights as stored + the KV cache of one sequence at `context` tokens, and $/Mtok the cost stack's
cost_per_million(decode tok/s, the device's hourly price) at batch 1.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path

DTYPES = ("fp32", "int8", "int4")


def timing_summary(samples: list[float]) -> dict:
    """{"median", "min", "max", "n"} of the timed samples."""
    if not samples:
        raise ValueError("no timed samples: repeats must be >= 1")
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def repeat_median(sample: Callable[[], dict[str, float]], warmup: int = 1, repeats: int = 3) -> dict[str, dict]:
    """Call `sample` warmup times (discarded), then `repeats` times; per key of its dict, the timing_summary."""
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"warmup={warmup!r} must be an integer >= 0")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    for _ in range(warmup):
        sample()
    samples = [sample() for _ in range(repeats)]
    return {key: timing_summary([s[key] for s in samples]) for key in samples[0]}


@dataclasses.dataclass
class SweepPoint:
    model: str                      # "teacher" or the student's name
    layers: int
    weight_dtype: str               # fp32 | int8 | int4
    score: float                    # the task's held-out score (field or intent accuracy)
    valid_json: float
    decode_tok_s: float             # median over the repeats, batch 1
    ttft_s: float                   # median
    weight_bytes: int
    kv_bytes: int                   # one sequence at the sweep's context
    usd_per_mtok: float
    is_teacher: bool = False
    timing: dict = dataclasses.field(default_factory=dict, repr=False)   # repeat_median's summaries

    @property
    def name(self) -> str:
        return f"{self.model} {self.weight_dtype}"

    @property
    def resident_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def _check_cost(cost: float, what: str) -> None:
    if not cost == cost:
        raise ValueError(f"{what} has no cost (NaN)")


def pareto_front(points: list, cost: Callable = lambda p: p.usd_per_mtok,
                 score: Callable = lambda p: p.score) -> list:
    """The points no other point beats on both axes (cost no higher, score no lower, one of them strictly),
    cheapest first."""
    front, best = [], float("-inf")
    for point in sorted(points, key=lambda p: (cost(p), -score(p))):
        _check_cost(cost(point), getattr(point, "name", repr(point)))
        if score(point) > best:
            front.append(point)
            best = score(point)
    return front


def pick_point(points: list, reference_score: float, margin: float, cost: Callable = lambda p: p.usd_per_mtok,
               score: Callable = lambda p: p.score):
    """The cheapest point whose score is at least reference_score - margin (the better score breaks a tie in cost),
    or None when no point meets that bar."""
    if not (isinstance(margin, (int, float)) and 0.0 <= margin <= 1.0):
        raise ValueError(f"margin={margin!r} is outside 0..1 (a fraction of the score, e.g. 0.05 for 5 points)")
    bar = reference_score - margin
    meeting = [p for p in points if score(p) >= bar - 1e-12]
    return min(meeting, key=lambda p: (cost(p), -score(p))) if meeting else None


def pick_line(pick, reference_score: float, margin: float, reference_name: str = "the teacher") -> str:
    bar = reference_score - margin
    if pick is None:
        return (f"pick: no point scores within {margin:.1%} of {reference_name}'s {reference_score:.1%} "
                f"(the bar: {bar:.1%}); none of them meets the bar, so {reference_name} stays the choice")
    return (f"pick: {pick.name} at {pick.usd_per_mtok:.3f} $/Mtok, score {pick.score:.1%} "
            f"(bar: {reference_name}'s {reference_score:.1%} - {margin:.1%} = {bar:.1%}), "
            f"{pick.resident_bytes / 1e6:.0f} MB resident")


def _levers(weight_dtype: str) -> dict:
    if weight_dtype not in DTYPES:
        raise ValueError(f"weight_dtype {weight_dtype!r} is not one of {list(DTYPES)}")
    return {"weight_dtype": None if weight_dtype == "fp32" else weight_dtype}


def measure_point(llm, model: str, weight_dtype: str, task: str, heldout: list, teacher: bool, context: int,
                  decode_tokens: int = 32, warmup: int = 1, repeats: int = 3, hourly_usd: float | None = None,
                  layers: int | None = None) -> SweepPoint:
    """Score one loaded engine on the held-out messages and time batch-1 greedy requests on the first one."""
    from ..bench.cost import cost_per_million
    from ..sampling import SamplingParams
    from .evaluate import generate_answers, score_answers
    from .tasks import prompt_text
    from .teacher import student_prompt_text

    scores = score_answers(task, heldout, generate_answers(llm, task, heldout, teacher=teacher))
    prompt = (prompt_text if teacher else student_prompt_text)(task, heldout[0].message)
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)

    def sample() -> dict[str, float]:
        metrics = llm.generate(prompt, params, use_tqdm=False)[0].metrics
        return {"ttft_s": metrics.ttft_s, "decode_tok_s": 1.0 / metrics.tpot_s}

    timing = repeat_median(sample, warmup, repeats)
    tok_s = timing["decode_tok_s"]["median"]
    hourly = llm.engine.hourly_usd if hourly_usd is None else hourly_usd
    return SweepPoint(model, layers or llm.model_config.num_layers, weight_dtype, scores["score"],
                      scores["valid_json"], tok_s, timing["ttft_s"]["median"], int(llm.weight_bytes),
                      int(llm.kv_bytes_per_token) * context, cost_per_million(tok_s, hourly), teacher, timing)


def run_sweep(models: dict[str, str | Path], task: str = "extract", num_heldout: int = 32,
              dtypes: tuple[str, ...] = DTYPES, teacher: str = "teacher", context: int = 2048,
              decode_tokens: int = 32, warmup: int = 1, repeats: int = 3, hourly_usd: float | None = None,
              progress: bool = True, threads: int | None = None) -> list[SweepPoint]:
    """One point per (model, dtype); `models` maps a name to an HF directory, the one named `teacher` reads the
    few-shot prompt. Every model of one name is loaded once, then re-quantized with with_levers."""
    from tqdm.auto import tqdm

    from ..llm import LLM
    from .tasks import make_examples

    if teacher not in models:
        raise ValueError(f"models {list(models)} have no {teacher!r}: the sweep measures students beside their teacher")
    for dtype in dtypes:
        _levers(dtype)
    if not (isinstance(context, int) and context >= 1):
        raise ValueError(f"context={context!r} must be an integer >= 1")
    heldout = make_examples(task, "heldout", num_heldout)
    points = []
    extra = {} if threads is None else {"num_threads": threads}
    with tqdm(total=len(models) * len(dtypes), desc="sweep", unit="point", disable=not progress) as bar:
        for name, path in models.items():
            base = LLM(str(path), **extra)
            for dtype in dtypes:
                bar.set_postfix_str(f"{name} {dtype}")
                llm = base.with_levers(**_levers(dtype)) if dtype != "fp32" else base
                points.append(measure_point(llm, name, dtype, task, heldout, name == teacher, context, decode_tokens,
                                            warmup, repeats, hourly_usd))
                bar.update(1)
    return points


def reference_point(points: list[SweepPoint]) -> SweepPoint:
    """The teacher in its model dtype (fp32): the score the bar is measured from."""
    for point in points:
        if point.is_teacher and point.weight_dtype == "fp32":
            return point
    teachers = [p for p in points if p.is_teacher]
    if not teachers:
        raise ValueError("no teacher point: the bar is the teacher's score")
    return teachers[0]


def format_sweep(points: list[SweepPoint], front: list[SweepPoint], pick, margin: float, context: int,
                 task: str = "extract") -> str:
    label = "field acc" if task == "extract" else "intent acc"
    on_front = {id(p) for p in front}
    lines = [f"{'point':<22}{'layers':>7}{label:>11}{'valid JSON':>11}{'decode tok/s':>14}{'TTFT ms':>9}"
             f"{'weights MB':>11}{f'+KV@{context} MB':>14}{'$/Mtok':>9}  front"]
    for p in sorted(points, key=lambda p: p.usd_per_mtok):
        mark = "*" if id(p) in on_front else ""
        mark += " <- pick" if p is pick else ""
        lines.append(f"{p.name:<22}{p.layers:>7}{p.score:>11.1%}{p.valid_json:>11.1%}{p.decode_tok_s:>14.1f}"
                     f"{p.ttft_s * 1e3:>9.1f}{p.weight_bytes / 1e6:>11.1f}{p.resident_bytes / 1e6:>14.1f}"
                     f"{p.usd_per_mtok:>9.3f}  {mark}")
    ref = reference_point(points)
    lines.append("* on the Pareto front (no other point is cheaper and scores higher); "
                 "$/Mtok at batch 1 = hourly price / 3600 / (decode tok/s) * 1e6")
    lines.append(pick_line(pick, ref.score, margin))
    return "\n".join(lines)


def sweep_figure(points: list[SweepPoint], front: list[SweepPoint], pick, margin: float, title: str | None = None):
    """Score against $/Mtok (log axis), one marker per point coloured by dtype, the front joined, the pick starred,
    the bar dashed."""
    import plotly.graph_objects as go

    ref = reference_point(points)
    figure = go.Figure()
    for dtype in DTYPES:
        chosen = [p for p in points if p.weight_dtype == dtype]
        if chosen:
            figure.add_trace(go.Scatter(
                x=[p.usd_per_mtok for p in chosen], y=[p.score for p in chosen], mode="markers+text", name=dtype,
                text=[p.model for p in chosen], textposition="top center", marker={"size": 10},
                hovertext=[f"{p.name}: {p.decode_tok_s:.0f} tok/s, {p.resident_bytes / 1e6:.0f} MB" for p in chosen]))
    figure.add_trace(go.Scatter(x=[p.usd_per_mtok for p in front], y=[p.score for p in front], mode="lines",
                                name="Pareto front", line={"width": 3, "color": "black"}))
    if pick is not None:
        figure.add_trace(go.Scatter(x=[pick.usd_per_mtok], y=[pick.score], mode="markers", name=f"pick: {pick.name}",
                                    marker={"symbol": "star", "size": 20, "color": "gold",
                                            "line": {"width": 1, "color": "black"}}))
    figure.add_hline(y=ref.score - margin, line_dash="dash",
                     annotation_text=f"bar: teacher {ref.score:.1%} - {margin:.1%}")
    figure.update_layout(title=title or "the smallest model that meets the bar: score vs $/Mtok",
                         xaxis_title="$ per million output tokens (batch 1, log)", yaxis_title="held-out score",
                         xaxis_type="log", template="plotly_white")
    return figure


def sweep_rows(points: list[SweepPoint]) -> list[dict]:
    """The points as plain dicts (for --json)."""
    return [{**dataclasses.asdict(p), "name": p.name, "resident_bytes": p.resident_bytes} for p in points]
