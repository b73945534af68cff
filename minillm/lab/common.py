"""Shared lab helpers: quick mode, device labels, plotly figures, timing, check plumbing.

Every lab module (lab00.py, lab01.py, ...) builds on these so figures look alike, every
measurement says which device it came from, and every check fails with a sentence.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import plotly.graph_objects as go

QUICK_ENV = "MINILLM_QUICK"

# A paragraph of plain English: prompts of a chosen length are cut from its repetitions, so
# timings are made on text the tokenizer sees every day (not on one token repeated).
FILLER_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
    "father had taught him. At the top he trimmed the wick, polished the great lens and wrote "
    "the weather into a book that nobody read. Ships passed far out at sea; some answered his "
    "light with a horn, most did not. In winter the wind found every gap in the stone walls, "
    "and he kept a kettle on the stove from dusk to dawn. "
)

# Published dense peaks (no sparsity) and memory bandwidths of some accelerators, for
# "what would this be on an H100" comparisons. FLOP/s at bf16/fp16 with tensor cores.
REFERENCE_DEVICES: dict[str, tuple[float, float]] = {
    "NVIDIA H100 SXM (bf16)": (989e12, 3.35e12),
    "NVIDIA H200 (bf16)": (989e12, 4.8e12),
    "NVIDIA A100 80GB SXM (bf16)": (312e12, 2.039e12),
    "NVIDIA RTX 4090 (bf16)": (165e12, 1.008e12),
}

# Parameter counts of some open models (embeddings included).
REFERENCE_MODELS: dict[str, float] = {
    "SmolLM2-135M": 134.5e6,
    "Llama-3.2-1B": 1.24e9,
    "Llama-2-7B": 6.74e9,
    "Llama-3.1-8B": 8.03e9,
    "Llama-2-70B": 68.98e9,
}

BYTES_PER_PARAM: dict[str, float] = {"fp32": 4, "bf16 / fp16": 2, "int8 / fp8": 1, "int4": 0.5}


# ------------------------------------------------------------------ quick mode, device
def quick_mode() -> bool:
    """True when MINILLM_QUICK=1: CI and the autograder run short sweeps."""
    return os.environ.get(QUICK_ENV) == "1"


def device_label(device: str = "auto") -> str:
    """'cpu: AMD EPYC (2 threads)' or 'cuda: NVIDIA H200': put it on every measured figure."""
    from ..hardware import device_name

    return device_name(device)


# ------------------------------------------------------------------ formatting
_SI = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]


def format_si(value: float, unit: str = "", digits: int = 3) -> str:
    """12.3e9, 'B/s' -> '12.3 GB/s'; small values keep their digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    for scale, prefix in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}".rstrip()


def format_seconds(seconds: float) -> str:
    """0.0123 -> '12.3 ms'; 2.5 -> '2.50 s'."""
    if seconds is None or math.isnan(seconds):
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


# ------------------------------------------------------------------ figures
def new_figure(
    title: str,
    x_title: str,
    y_title: str,
    device: str | None = None,
    widget: bool = False,
    height: int = 400,
    log_x: bool = False,
    log_y: bool = False,
) -> go.Figure:
    """A plotly figure in the course's style. `device` becomes the subtitle: a measured figure
    always says which hardware it came from. `widget=True` returns a FigureWidget that
    ipywidgets callbacks can update in place — but a FigureWidget shown inside a VBox loses
    traces added after its construction, so add every trace to a plain figure first and wrap
    it with :func:`as_widget`."""
    cls = go.FigureWidget if widget else go.Figure
    title_spec: dict = {"text": title}
    if device:
        title_spec["subtitle"] = {"text": device if device.startswith(("measured", "model")) else f"measured on {device}"}
    fig = cls(
        layout=dict(
            title=title_spec,
            xaxis_title=x_title,
            yaxis_title=y_title,
            height=height,
            template="plotly_white",
            margin=dict(t=80 if device else 60, l=70, r=30, b=60),
        )
    )
    # Log axes label decades only, in SI units (1G, 10G), so many decades stay readable.
    if log_x:
        fig.update_xaxes(type="log", dtick=1, exponentformat="SI")
    if log_y:
        fig.update_yaxes(type="log", dtick=1, exponentformat="SI")
    return fig


def as_widget(fig: go.Figure) -> go.FigureWidget:
    """A FigureWidget holding all of `fig`'s traces and layout from its construction on.

    Plotly's FigureWidget sends traces added later (`add_scatter`) as messages that a view
    nested in an ipywidgets container can miss (in JupyterLab 4 a line lost its x values);
    traces given at construction are part of the widget's initial state and always arrive.
    Callbacks then update them in place (`fig.data[i].y = ...`), which is reliable."""
    return go.FigureWidget(data=fig.data, layout=fig.layout)


def control_panel(owner, controls: list, figure: go.Figure, row: bool = False) -> None:
    """The widgets' common wiring: owner.figure = as_widget(figure), owner.label (an HTML line the
    update writes), owner.widget = the controls (side by side with row=True), the label and the
    figure stacked; a change of any control's value calls owner.update(), and one update() runs now."""
    import ipywidgets as widgets

    owner.label = widgets.HTML()
    owner.figure = as_widget(figure)
    for control in controls:
        control.observe(lambda _: owner.update(), names="value")
    top = [widgets.HBox(controls)] if row else list(controls)
    owner.widget = widgets.VBox([*top, owner.label, owner.figure])
    owner.update()


def figure_subtitle(fig: go.Figure) -> str:
    """The subtitle text of a figure from :func:`new_figure` ('' if none)."""
    subtitle = fig.layout.title.subtitle
    return (subtitle.text or "") if subtitle is not None else ""


# ------------------------------------------------------------------ prompts
def prompt_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """Exactly `num_tokens` token ids of plain English (BOS first when the tokenizer adds one)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens} must be >= 1")
    ids: list[int] = tokenizer.encode(FILLER_TEXT, add_special_tokens=True)
    body = tokenizer.encode(FILLER_TEXT, add_special_tokens=False)
    while len(ids) < num_tokens:
        ids += body
    return ids[:num_tokens]


# ------------------------------------------------------------------ timing
class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds`."""

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        self.seconds = float("nan")
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def time_call(fn: Callable[[], object], repeats: int = 3, warmup: int = 1, reduce: str = "min") -> float:
    """Seconds one call of `fn` takes: `min` (default, the least disturbed by other processes)
    or `median` of `repeats` timed calls after `warmup` untimed ones."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if reduce == "min":
        return min(times)
    if reduce == "median":
        return statistics.median(times)
    raise ValueError(f"reduce={reduce!r} must be 'min' or 'median'")


# ------------------------------------------------------------------ checks
class CheckFailed(AssertionError):
    """A check_* function's verdict: the message says what is wrong and why it probably is."""


def call_learner(fn: Callable, args: tuple, call: str | None = None, hint: str = "", *, name: str | None = None):
    """Call the learner's function; an exception (other than the stub's NotImplementedError or a
    CheckFailed from inside) becomes a CheckFailed naming the call, plus an optional hint. The call is
    named by ``call``, else as ``name(args...)`` (``name``: the function's own name by default)."""
    if call is None:
        call = call_repr(name or getattr(fn, "__name__", "your function"), args)
    try:
        return fn(*args)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as exc:  # noqa: BLE001 - the message names the learner's error
        raise CheckFailed(f"{call} raised {type(exc).__name__}: {exc}" + (f": {hint}" if hint else "")) from exc


def is_close(actual, expected: float, rel: float = 1e-6, abs_tol: float = 1e-12) -> bool:
    try:
        return math.isclose(float(actual), float(expected), rel_tol=rel, abs_tol=abs_tol)
    except (TypeError, ValueError):
        return False


def call_repr(name: str, args: Sequence) -> str:
    return f"{name}({', '.join(_short(a) for a in args)})"


def _short(value) -> str:
    if isinstance(value, float) and value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)) and len(value) > 6:
        return f"[{', '.join(_short(v) for v in value[:3])}, ... ({len(value)} items)]"
    return repr(value)


def expect_number(name: str, args: Sequence, actual, expected: float, hint: str = "", rel: float = 1e-6) -> None:
    """Raise CheckFailed with 'f(args) returned A, expected E: hint' unless actual ≈ expected."""
    if isinstance(actual, bool) or not isinstance(actual, (int, float)) and not hasattr(actual, "__float__"):
        raise CheckFailed(f"{call_repr(name, args)} returned {actual!r} ({type(actual).__name__}); expected a number, {expected:.4g}")
    if not is_close(actual, expected, rel=rel):
        message = f"{call_repr(name, args)} returned {float(actual):.4g}, expected {expected:.4g}"
        raise CheckFailed(message + (f": {hint}" if hint else ""))


def echo_prediction(what: str, predicted, measured, unit: str = "", digits: int = 3) -> None:
    """Print the learner's prediction beside the measured value, and for a number how far off it was.

    ``predicted`` is the ``predicted_*`` variable a lab's Predict cell asks for (None while unset);
    numbers are compared as a ratio (``off by 2.1x``) and a signed percentage, anything else (a word,
    a choice, True/False) as equal or not. Prints one line and returns None, so it can end any cell."""
    shown = _format_measured(measured, unit, digits)
    if predicted is None:
        print(f"{what}: measured {shown}; you predicted nothing (fill in the predicted_ variable above, re-run)")
        return
    numeric = (isinstance(predicted, (int, float)) and not isinstance(predicted, bool)
               and isinstance(measured, (int, float)) and not isinstance(measured, bool))
    if not numeric:
        same = str(predicted).strip().lower() == str(measured).strip().lower()
        print(f"{what}: you predicted {predicted!r}, measured {measured!r}: "
              + ("right" if same else "not this time"))
        return
    guess = _format_measured(predicted, unit, digits)
    if measured == 0 or predicted == 0:
        off = "exact" if predicted == measured else f"off by {abs(predicted - measured):.{digits}g}{unit}"
    else:
        error = predicted / measured - 1
        ratio = max(predicted / measured, measured / predicted) if predicted * measured > 0 else None
        direction = "high" if abs(predicted) > abs(measured) else "low"
        off = ("the wrong sign" if ratio is None else "spot on" if abs(error) < 0.005 else
               f"{error:+.0%}, too {direction}" if ratio < 2 else f"{ratio:.1f}x too {direction}")
    print(f"{what}: you predicted {guess}, measured {shown} ({off})")


def _format_measured(value, unit: str, digits: int) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return repr(value)
    return f"{value:.{digits}g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def passed(name: str, num_cases: int) -> None:
    """Print a check's verdict. Checks return None: nbgrader reads the value a test cell ends on as a
    partial score (a string there is a warning now and an error in a later nbgrader)."""
    print(f"✓ {name}: all {num_cases} cases pass")


# --- Triton kernel exercises (labs 04 and 05) ------------------------------------------------------
# Each lab writes a kernel, plugs it into the engine (its own part: an attention backend, a matmul
# hook) and times it on a GPU; checking for the stub, the greedy runs, and the printouts are these.
def require_kernel(kernel) -> None:
    """NotImplementedError while a @triton.jit kernel's body is still the exercise stub (under the
    interpreter the stub's own raise would arrive wrapped in an InterpreterError; on a GPU it would
    not even compile). The notebooks' launchers call it as ``labNN.require_kernel(the_kernel)``."""
    import inspect

    fn = getattr(kernel, "fn", kernel)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = getattr(kernel, "src", "")
    if "raise NotImplementedError" in source:
        name = getattr(fn, "__name__", "the kernel")
        raise NotImplementedError(f"{name} is still a stub: write its body (the exercise that defines {name})")


def chat_prompts(llm, conversations) -> list[dict]:
    """Each conversation (a list of {"role", "content"} messages) as a prompt of token ids, in the model's
    chat template: the prompts the labs' engine runs send."""
    return [{"prompt_token_ids": llm.chat_token_ids(list(messages))} for messages in conversations]


def random_tokens(num_tokens: int, features: int, seed: int = 0):
    """[num_tokens, features] standard-normal activations, seeded (a check's fresh inputs)."""
    import torch

    return torch.randn(num_tokens, features, generator=torch.Generator().manual_seed(seed + 1000))


def chi_square_p_value(counts, probs) -> float:
    """Pearson's chi-square test of observed counts against the distribution probs: the p-value Q(df / 2, x / 2)
    (the regularized upper incomplete gamma). Tokens of probability 0 are left out, and a draw of one gives 0.0;
    fewer than two possible tokens gives 1.0 (nothing to test)."""
    import torch

    counts, probs = torch.as_tensor(counts).double(), torch.as_tensor(probs).double()
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return 0.0
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    if df < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


CHECK_POOL_TOKENS = 1024  # KV slots of a check's engine: a few prompts of a few tokens fit with room to spare
_CHECK_ENGINES: dict[int, object] = {}


def check_engine(llm, tokens: int = CHECK_POOL_TOKENS):
    """`llm` with a small KV pool (`tokens` slots), sharing its weights, made once per engine: the engine a
    check plugs the learner's part into. When a grader runs the learner's code elsewhere and passes every
    call's tensors across, a layer's pool of a thousand slots crosses in a blink; the default pool (the
    machine's memory share) would be tens of megabytes per call."""
    key = id(llm)
    engine = _CHECK_ENGINES.get(key)
    if engine is None or engine[0] is not llm:
        engine = _CHECK_ENGINES[key] = (llm, llm.with_levers(kv_cache_bytes=tokens * llm.kv_bytes_per_token)
                                        if llm.config.kv_cache else llm)
    return engine[1]


def greedy_tokens(llm, prompts: Sequence, max_tokens: int) -> list[list[int]]:
    """Each prompt's first ``max_tokens`` greedy tokens (EOS ignored): a run with the learner's part
    plugged in is compared with a reference run on these."""
    from ..sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(list(prompts), params)]


def print_kernel_run(result: dict, references: Sequence[tuple[str, list, str]], calls: int, launches: str) -> None:
    """A kernel-in-the-engine run's printout: the learner's greedy tokens (``result["tokens"]``) against
    each reference, given as (whose, their tokens, why a difference is no bug or "" when it is one),
    then the text, the ``calls`` launches of the kernel (``launches`` says which) and their time
    (``result["kernel_s"]``), the run's wall time and device, and what that time means without a GPU."""
    print(f"your kernel's tokens: {result['tokens']}")
    for whose, tokens, tolerated in references:
        if tokens == result["tokens"]:
            print(f"  ✓ the same as {whose}")
        else:
            print(f"  {'≈' if tolerated else '✗'} not the same as {whose}: {tokens}" + (f"  ({tolerated})" if tolerated else ""))
    print(f"  text: {result['text']}")
    print(f"  {launches}: {calls} launches, {format_seconds(result['kernel_s'] / max(1, calls))} each; "
          f"{format_seconds(result['wall_s'])} in all — {result['device']}")
    print_interpreter_note()


def gpu_seconds(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes on the GPU (Triton's do_bench: warmed up, the L2 cache flushed)."""
    import triton.testing

    return triton.testing.do_bench(fn) / 1e3


def print_kernel_timing(result: dict, rows: Sequence[tuple[str, str]], no_gpu: str) -> None:
    """A kernel timing's printout. Without a GPU (``result["device"] == "cpu"``) what the cell would time
    (``no_gpu`` ends "On a GPU this cell times your kernel ..."). On a GPU: the shape, the device and its
    measured bandwidth, then for each (name, bytes key) of ``rows`` the time ``result[name + "_s"]``,
    the bytes that call must read (``result[bytes key]``), the time reading them takes at the measured
    bandwidth (the bound of a memory-bound kernel) and how close the call comes to it."""
    if result["device"] == "cpu":
        print_no_gpu_timing(no_gpu)
        return
    bandwidth = result["bandwidth"]
    print(f"{result['shape']} — {result['device']}; measured bandwidth {bandwidth / 1e9:.0f} GB/s")
    for name, key in rows:
        seconds, nbytes = result[f"{name}_s"], result[key]
        print(f"  {name:>6}: {format_seconds(seconds)}  reads {format_si(nbytes, 'B')} (bound "
              f"{format_seconds(nbytes / bandwidth)}) -> {nbytes / seconds / 1e9:.0f} GB/s, "
              f"{nbytes / seconds / bandwidth:.0%} of the bound")


def print_interpreter_note() -> None:
    """After a kernel run's timing on a machine without CUDA: what that time means."""
    import torch

    if not torch.cuda.is_available():
        print("  (Triton's interpreter runs each program in numpy: this time says nothing about the GPU's speed)")


def print_no_gpu_timing(what: str) -> None:
    """A timing cell's output without a GPU; ``what`` ends "On a GPU this cell times your kernel ..."."""
    print("No GPU here: the kernel ran in Triton's interpreter, which checks values, not speed.")
    print(f"On a GPU this cell times your kernel {what}.")


# --- The learner's timing harness, graded without a clock ------------------------------------------
# Every lab 01-11 has the learner write the measurement: warm up, repeat, take the median and the spread,
# compute the lab's ratio. A check cannot compare times (machines differ, and a busy one lies), so it hands
# the learner's harness a FakeClock in place of time.perf_counter and a fake engine whose calls move that
# clock by known costs: the warm-up calls cost much more, the timed ones vary, one is an outlier. Then
# the median, the spread and the ratio each have exactly one right value, and keeping the warm-up, taking
# the mean, the min or the first sample each give another one (timing_mistake names which).
class FakeClock:
    """A clock that moves only when told: ``clock()`` reads it (as ``time.perf_counter()`` would),
    ``clock.advance(seconds)`` is what a fake engine's call does to it."""

    def __init__(self, start: float = 1000.0):
        self.now = float(start)
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"seconds={seconds!r} must be >= 0: a clock does not run backwards")
        self.now += float(seconds)


def scripted_costs(base: float, warmup: int, repeats: int, seed: int = 0) -> list[float]:
    """Seconds each of ``warmup + repeats`` calls costs, in call order: each warm-up call 20x ``base`` (a
    compile, a cold cache), the timed ones ``base`` times a factor in [0.8, 1.2] with one 4x outlier (another
    process took the core), so that the median differs from the mean, the min, the first sample, and from any
    statistic that keeps a warm-up call. ``repeats`` >= 3."""
    import random

    if repeats < 3 or warmup < 0 or not base > 0:
        raise ValueError(f"scripted_costs(base={base!r}, warmup={warmup!r}, repeats={repeats!r}): "
                         "base > 0, warmup >= 0 and repeats >= 3")
    rng = random.Random(seed)
    timed = [base * rng.uniform(0.8, 1.2) for _ in range(repeats)]
    timed[rng.randrange(1, repeats)] = base * 4.0
    return [base * 20.0] * warmup + timed


def timing_summary(samples: Sequence[float]) -> dict:
    """The reference statistics of timed samples (warm-up already dropped): median, min, max, count."""
    if not samples:
        raise ValueError("timing_summary needs at least one timed sample")
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def timing_mistake(got: float, costs: Sequence[float], warmup: int) -> str:
    """Why ``got`` is not the median of ``costs[warmup:]``: the statistic it matches, or ''."""
    timed, every = list(costs[warmup:]), list(costs)
    guesses = [
        (statistics.median(every), "the median of every call, warm-up included: drop the first `warmup` calls"),
        (statistics.fmean(timed), "the mean: one slow outlier moves it, use the median"),
        (statistics.fmean(every), "the mean of every call, warm-up included"),
        (min(timed), "the minimum: report the median (and the min and max as the spread)"),
        (max(timed), "the maximum: report the median"),
        (timed[0], "the first timed call alone: repeat and take the median"),
        (every[0], "the first call, a warm-up: it pays for compiling and cold caches"),
        (sum(timed), "the total of the timed calls: divide, or take the median of each call's time"),
    ]
    for value, why in guesses:
        if is_close(got, value, rel=1e-6):
            return why
    return ""


def print_beside_reference(what: str, yours: float, reference: float, reference_hardware: str, unit: str = "",
                           digits: int = 3, device: str = "auto") -> None:
    """Your measurement on this machine beside the course's reference run, each labelled with its hardware."""
    print(f"{what}: yours {_format_measured(float(yours), unit, digits)} on {device_label(device)}; "
          f"reference {_format_measured(float(reference), unit, digits)} on {reference_hardware}")
