"""Lab 00 helpers: the doctor table, where one request's time goes, checks, the e2e slider.

The learner writes `tokens_per_second`, `e2e_latency_s` and `count_tokens` in the notebook;
the check_* functions test them and say what is probably wrong.
"""

from __future__ import annotations

import html
import sys
from collections.abc import Callable

import ipywidgets as widgets
import plotly.graph_objects as go

from .common import CheckFailed, as_widget, call_repr, expect_number, is_close, new_figure, passed


# ------------------------------------------------------------------ doctor
def _fallback_doctor(load_model: bool = True) -> list[tuple[str, bool, str]]:
    """The essential checks, for when `minillm.cli.run_doctor` is not available."""
    import torch

    from ..hardware import device_name

    checks = [
        ("python", sys.version_info >= (3, 10), f"{sys.version.split()[0]} (3.10 or newer needed)"),
        ("torch", True, torch.__version__),
        ("device", True, device_name()),
    ]
    try:
        import triton

        checks.append(("triton", True, triton.__version__))
    except Exception as exc:
        checks.append(("triton", False, f"cannot import triton ({exc})"))
    if load_model:
        try:
            from .. import LLM, SamplingParams

            text = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=4))[0].outputs[0].text
            checks.append(("default model answers", "Paris" in text, f"'The capital of France is' -> {text!r}"))
        except Exception as exc:
            checks.append(("default model answers", False, f"{type(exc).__name__}: {exc}"))
    return checks


def run_doctor(load_model: bool = True) -> list[tuple[str, bool, str]]:
    """(name, ok, message) for each check: `minillm doctor`'s checks, the same as the CLI's."""
    try:
        from ..cli import run_doctor as cli_run_doctor
    except ImportError:
        return _fallback_doctor(load_model)
    return cli_run_doctor(load_model=load_model)


def doctor_html(checks: list[tuple[str, bool, str]]) -> str:
    """The checks as an HTML table, problems in red, with a verdict line under it."""
    rows = "".join(
        f"<tr><td style='padding:2px 10px'>{'✅' if ok else '❌'}</td><td style='padding:2px 10px'><b>{html.escape(name)}</b></td>"
        f"<td style='padding:2px 10px;text-align:left;color:{'inherit' if ok else '#b00020'}'>{html.escape(message)}</td></tr>"
        for name, ok, message in checks
    )
    bad = [name for name, ok, _ in checks if not ok]
    verdict = "All good: the engine, the kernels and the model work here." if not bad else (
        f"{len(bad)} problem(s): {', '.join(bad)}. Fix them before going on (the message says how).")
    return f"<table>{rows}</table><p><b>{html.escape(verdict)}</b></p>"


# ------------------------------------------------------------------ where the time goes
def time_breakdown(metrics) -> dict:
    """Split one request's end-to-end time into queue, prefill (the first token) and decode."""
    queue_s = metrics.queue_s or 0.0
    return {
        "queue_s": queue_s,
        "prefill_s": metrics.ttft_s - queue_s,
        "decode_s": metrics.e2e_s - metrics.ttft_s,
        "e2e_s": metrics.e2e_s,
        "num_prompt_tokens": metrics.num_prompt_tokens,
        "num_output_tokens": metrics.num_output_tokens,
    }


def breakdown_figure(metrics, device: str) -> go.Figure:
    """One stacked horizontal bar: waiting, prefill (-> first token), decode (the other tokens)."""
    parts = time_breakdown(metrics)
    n_out = parts["num_output_tokens"]
    fig = new_figure(
        f"Where the time goes: {parts['num_prompt_tokens']} prompt tokens -> {n_out} output tokens, "
        f"{parts['e2e_s']:.2f} s end to end",
        "seconds", "", device=device, height=300,
    )
    segments = [
        ("queue", parts["queue_s"], "lightgray"),
        ("prefill: prompt -> 1st token (TTFT)", parts["prefill_s"], "royalblue"),
        (f"decode: {n_out - 1} more tokens, one per step", parts["decode_s"], "firebrick"),
    ]
    for name, seconds, color in segments:
        fig.add_bar(x=[seconds], y=["this request"], orientation="h", name=name, marker_color=color,
                    text=[f"{seconds:.2f} s"], textposition="inside", hovertemplate=f"{name}: %{{x:.3f}} s<extra></extra>")
    fig.update_layout(barmode="stack", legend_traceorder="normal")
    return fig


class LatencyExplorer:
    """A slider for the number of output tokens and a stacked bar of the predicted end-to-end
    latency, computed with the learner's `e2e_latency_s` from measured TTFT and TPOT."""

    def __init__(self, ttft_s: float, tpot_s: float, e2e_latency_s: Callable, device: str, max_tokens: int = 1024):
        self.ttft_s, self.tpot_s, self.e2e_latency_s = ttft_s, tpot_s, e2e_latency_s
        self.slider = widgets.IntSlider(value=16, min=1, max=max_tokens, step=1, description="output tokens",
                                        style={"description_width": "100px"}, layout=widgets.Layout(width="520px"))
        figure = new_figure("Predicted end-to-end latency", "seconds", "", device=device, height=280)
        figure.add_bar(x=[ttft_s], y=["predicted"], orientation="h", name="TTFT", marker_color="royalblue")
        figure.add_bar(x=[0.0], y=["predicted"], orientation="h", name="decode", marker_color="firebrick")
        figure.update_layout(barmode="stack", legend_traceorder="normal")
        self.figure = figure
        self.readout = widgets.HTML()
        self.slider.observe(self.update, names="value")
        self.update()  # fills the plain figure; the widget is born with the right data
        self.figure = as_widget(figure)
        self.widget = widgets.VBox([self.slider, self.figure, self.readout])

    def update(self, change=None) -> None:
        n = self.slider.value
        try:
            e2e = self.e2e_latency_s(self.ttft_s, self.tpot_s, n)
        except NotImplementedError:
            self.readout.value = "<i>Write e2e_latency_s (exercise 2) to see the prediction.</i>"
            return
        # One update per trace (no batch_update(): see RooflineExplorer.update in lab01.py).
        self.figure.data[1].x = [e2e - self.ttft_s]
        self.figure.layout.title.text = f"Predicted end-to-end latency for {n} output tokens: {e2e:.2f} s"
        self.readout.value = (f"{n} tokens: TTFT {self.ttft_s:.2f} s + decode {e2e - self.ttft_s:.2f} s = <b>{e2e:.2f} s</b>; "
                              f"decode is {(e2e - self.ttft_s) / e2e:.0%} of it.")


# ------------------------------------------------------------------ checks
def check_tokens_per_second(tokens_per_second: Callable) -> None:
    """tokens / seconds; a ValueError (naming the value) for seconds <= 0."""
    name = "tokens_per_second"
    cases = [(100, 2.0), (16, 0.25), (1, 4.0), (4096, 1.6)]
    for num_tokens, seconds in cases:
        got = tokens_per_second(num_tokens, seconds)
        want = num_tokens / seconds
        inverted = is_close(got, seconds / num_tokens) and not is_close(want, seconds / num_tokens)
        hint = "that is seconds per token; tokens per second is num_tokens / seconds" if inverted else ""
        expect_number(name, (num_tokens, seconds), got, want, hint)
    for seconds in (0, -1.0):
        try:
            got = tokens_per_second(10, seconds)
        except ValueError:
            continue
        except ZeroDivisionError:
            raise CheckFailed(f"{call_repr(name, (10, seconds))} raised ZeroDivisionError; raise a ValueError that "
                              "names the bad value instead (e.g. 'seconds=0 must be > 0')") from None
        raise CheckFailed(f"{call_repr(name, (10, seconds))} returned {got!r}; a duration must be > 0: raise ValueError")
    passed(name, len(cases) + 2)


def check_e2e_latency(e2e_latency_s: Callable) -> None:
    """e2e = TTFT + TPOT * (num_output_tokens - 1): the first token comes out of the prefill."""
    name = "e2e_latency_s"
    cases = [(0.5, 0.05, 11), (2.0, 0.25, 16), (0.1, 0.02, 1), (1.2, 0.04, 256)]
    for ttft, tpot, n in cases:
        got = e2e_latency_s(ttft, tpot, n)
        want = ttft + tpot * (n - 1)
        hint = ""
        if is_close(got, ttft + tpot * n) and n != 0:
            hint = ("off by one token: the first token comes out of the prefill (TTFT), so only "
                    "num_output_tokens - 1 tokens take a TPOT each")
        elif is_close(got, tpot * n):
            hint = "add the time to the first token: e2e = TTFT + the decode steps after it"
        expect_number(name, (ttft, tpot, n), got, want, hint)
    passed(name, len(cases))


CHECK_TEXTS = ["Hello world", "The capital of France is", "def f(x):\n    return 2 * x",
               "Donaudampfschifffahrtsgesellschaft", "🙂 tokens are not words"]


def check_count_tokens(count_tokens: Callable, tokenizer) -> None:
    """The number of token ids the engine feeds for a prompt: len(tokenizer.encode(text))."""
    name = "count_tokens"
    for text in CHECK_TEXTS:
        got = count_tokens(tokenizer, text)
        want = len(tokenizer.encode(text))
        if got == len(text) and want != len(text):
            hint = "that is the number of characters; a token is usually several characters: use tokenizer.encode"
        elif got == len(text.split()) and want != len(text.split()):
            hint = "that is the number of words; tokens are not words (long or rare words split into several)"
        else:
            hint = "count the ids that tokenizer.encode(text) returns"
        if isinstance(got, bool) or not isinstance(got, int):
            raise CheckFailed(f"count_tokens(tokenizer, {text!r}) returned {got!r}; expected an int, {want}")
        if got != want:
            raise CheckFailed(f"count_tokens(tokenizer, {text!r}) returned {got}, expected {want}: {hint}")
    passed(name, len(CHECK_TEXTS))
