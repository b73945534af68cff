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

import math

from .common import (CheckFailed, as_widget, call_learner, call_repr, expect_number, is_close,
                     new_figure, passed)


# ------------------------------------------------------------------ doctor
def _fallback_doctor(load_model: bool = True) -> list[tuple[str, bool, str]]:
    """The essential checks, for when `minillm.cli.doctor.run_doctor` is not available."""
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
        from ..cli.doctor import run_doctor as cli_run_doctor
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
        got = call_learner(tokens_per_second, (num_tokens, seconds), name=name)
        want = num_tokens / seconds
        inverted = is_close(got, seconds / num_tokens) and not is_close(want, seconds / num_tokens)
        hint = "that is seconds per token; tokens per second is num_tokens / seconds" if inverted else ""
        expect_number(name, (num_tokens, seconds), got, want, hint)
    for seconds in (0, -1.0):
        expect_bad_duration(tokens_per_second, 10, seconds)
    passed(name, len(cases) + 2)


def expect_bad_duration(tokens_per_second: Callable, num_tokens, seconds) -> None:
    """tokens_per_second(num_tokens, seconds) with seconds <= 0 must raise a ValueError whose message names it."""
    call = call_repr("tokens_per_second", (num_tokens, seconds))
    try:
        got = tokens_per_second(num_tokens, seconds)
    except ValueError as error:
        if str(seconds) not in str(error):
            raise CheckFailed(f"{call} raised ValueError({str(error)!r}); the message must name the bad value, "
                              f"e.g. 'seconds={seconds} must be > 0'") from None
        return
    except ZeroDivisionError:
        raise CheckFailed(f"{call} raised ZeroDivisionError; raise a ValueError that names the bad value instead "
                          "(e.g. 'seconds=0 must be > 0')") from None
    except Exception as error:  # noqa: BLE001 - the message names the learner's error
        raise CheckFailed(f"{call} raised {type(error).__name__}: {error}; raise ValueError for a duration that is "
                          "not positive") from None
    raise CheckFailed(f"{call} returned {got!r}; a duration must be > 0: raise ValueError")


def check_tokens_per_second_edges(tokens_per_second: Callable) -> None:
    """The edges of the contract: no tokens is 0 tokens/s (a valid measurement), a tiny duration is a big
    number (not an error), and every duration that is not positive is a ValueError naming it."""
    name = "tokens_per_second"
    for num_tokens, seconds in ((0, 1.0), (3, 1e-3), (1, 1e-6)):
        got = call_learner(tokens_per_second, (num_tokens, seconds), name=name)
        hint = ("no tokens in a positive time is 0 tokens/s, not an error" if num_tokens == 0 else
                "only a duration <= 0 is invalid; a short one gives a large rate")
        expect_number(name, (num_tokens, seconds), got, num_tokens / seconds, hint)
    bad_values = (0.0, -0.5, -3)
    for seconds in bad_values:
        expect_bad_duration(tokens_per_second, 5, seconds)
    passed(f"{name} at the edges", 3 + len(bad_values))


def check_e2e_latency(e2e_latency_s: Callable) -> None:
    """e2e = TTFT + TPOT * (num_output_tokens - 1): the first token comes out of the prefill."""
    name = "e2e_latency_s"
    cases = [(0.5, 0.05, 11), (2.0, 0.25, 16), (0.1, 0.02, 1), (1.2, 0.04, 256)]
    for ttft, tpot, n in cases:
        got = call_learner(e2e_latency_s, (ttft, tpot, n), name=name)
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
        got = call_learner(count_tokens, (tokenizer, text), f"count_tokens(tokenizer, {text!r})")
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


def check_count_tokens_engine(count_tokens: Callable, tokenizer, output) -> None:
    """count_tokens agrees with the ids the engine fed for a request it ran (RequestOutput.prompt_token_ids)."""
    got = call_learner(count_tokens, (tokenizer, output.prompt), f"count_tokens(tokenizer, {output.prompt!r})")
    want = len(output.prompt_token_ids)
    if got != want:
        hint = (" (the engine adds no token you leave out: count what tokenizer.encode returns, special tokens"
                " included)" if got == want - 1 else "")
        raise CheckFailed(f"count_tokens(tokenizer, {output.prompt!r}) returned {got!r}; the engine fed {want} ids "
                          f"for that prompt{hint}")
    passed("count_tokens against the engine", 1)


def check_e2e_matches_engine(e2e_latency_s: Callable, metrics) -> None:
    """Your formula on a request the engine ran: within 1 % of the e2e it measured."""
    args = (metrics.ttft_s, metrics.tpot_s, metrics.num_output_tokens)
    got = call_learner(e2e_latency_s, args, name="e2e_latency_s")
    hint = ("off by one token: the first token comes out of the prefill" if
            is_close(got, metrics.ttft_s + metrics.tpot_s * metrics.num_output_tokens, rel=1e-3) else
            "e2e = TTFT + TPOT * (num_output_tokens - 1)")
    expect_number("e2e_latency_s", args, got, metrics.e2e_s, f"the engine measured {metrics.e2e_s:.4f} s: {hint}",
                  rel=0.01)
    passed("e2e_latency_s against the engine", 1)


def check_rates(metrics, prompt_tokens_per_s, decode_tokens_per_s) -> None:
    """Prefill speed = prompt tokens / TTFT; decode speed = the tokens after the first / the time after the first."""
    n_in, n_out, ttft, e2e = metrics.num_prompt_tokens, metrics.num_output_tokens, metrics.ttft_s, metrics.e2e_s
    for label, value in (("prompt_tokens_per_s", prompt_tokens_per_s), ("decode_tokens_per_s", decode_tokens_per_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CheckFailed(f"{label} = {value!r}: expected a number of tokens per second")
    case = (f"(this request: {n_in} prompt tokens, {n_out} output tokens, TTFT {ttft:.4f} s, e2e {e2e:.4f} s)")
    want_prefill = n_in / ttft
    if not is_close(prompt_tokens_per_s, want_prefill, rel=1e-6):
        hint = ("that divides by the whole e2e; prefill is the time to the first token" if
                is_close(prompt_tokens_per_s, n_in / e2e, rel=1e-6) else
                "that is seconds per token" if is_close(prompt_tokens_per_s, ttft / n_in, rel=1e-6) else
                "prefill reads the prompt tokens in the TTFT")
        raise CheckFailed(f"prompt_tokens_per_s = {prompt_tokens_per_s:.4g}, expected {want_prefill:.4g} "
                          f"{case}: {hint}")
    want_decode = (n_out - 1) / (e2e - ttft)
    if not is_close(decode_tokens_per_s, want_decode, rel=1e-6):
        hint = ("off by one token: the first token came out of the prefill, so decode made num_output_tokens - 1" if
                is_close(decode_tokens_per_s, n_out / (e2e - ttft), rel=1e-6) else
                "that divides by the whole e2e; decode is the time after the first token" if
                is_close(decode_tokens_per_s, (n_out - 1) / e2e, rel=1e-6) or is_close(decode_tokens_per_s, n_out / e2e, rel=1e-6)
                else "decode makes num_output_tokens - 1 tokens in e2e - TTFT")
        raise CheckFailed(f"decode_tokens_per_s = {decode_tokens_per_s:.4g}, expected {want_decode:.4g} {case}: {hint}")
    passed("prefill and decode speeds", 2)


def decode_90_tokens(ttft_s: float, tpot_s: float) -> int:
    """The shortest answer (output tokens) whose decode time is at least 90 % of its end-to-end latency:
    TPOT (n - 1) >= 0.9 (TTFT + TPOT (n - 1))  <=>  n - 1 >= 9 TTFT / TPOT."""
    return max(1, math.ceil(9 * ttft_s / tpot_s - 1e-9) + 1)


def check_answer_decode_90(answer, metrics) -> None:
    """Explain question 1: the answer length at which decode is 90 % of the time, within a token or 2 %."""
    want = decode_90_tokens(metrics.ttft_s, metrics.tpot_s)
    case = f"TTFT {metrics.ttft_s * 1e3:.1f} ms and TPOT {metrics.tpot_s * 1e3:.2f} ms"
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        raise CheckFailed(f"answer_decode_90_tokens = {answer!r}: expected a number of output tokens")
    if abs(answer - want) > max(1.0, 0.02 * want):
        share = (metrics.tpot_s * (answer - 1) / (metrics.ttft_s + metrics.tpot_s * (answer - 1))) if answer >= 1 else 0.0
        raise CheckFailed(f"answer_decode_90_tokens = {answer:g}: with {case}, {answer:g} output tokens spend "
                          f"{share:.0%} of the time in decode, not 90 %; decode is TPOT (n - 1) out of "
                          f"TTFT + TPOT (n - 1)")
    passed("decode is 90 % of the time", 1)
