"""Lab 01 helpers: prefill vs decode — checks, figures, the roofline and the explorer widget.

The learner writes four small functions in the notebook (`ttft_tpot_s`, `arithmetic_intensity`,
`roofline_time_s`, `decode_bandwidth_bound_tokens_per_s`); the check_* functions here test them
and say what is probably wrong; the figures and the RooflineExplorer plug them in. The
measurements (measure_ttft, measure_decode, token_times_from_metrics, measured_points) are
written in the notebook itself, where the learner reads them.
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
def check_ttft_tpot(ttft_tpot_s: Callable) -> None:
    """TTFT = first token time - arrival; TPOT = mean gap between the tokens after the first."""
    name = "ttft_tpot_s"
    cases = [
        (10.0, [10.5, 10.6, 10.7, 10.9]),
        (0.0, [0.25, 0.5]),
        (3.0, [3.2, 3.3, 3.5, 3.6, 4.2, 4.3]),
    ]
    for arrival, times in cases:
        args = (arrival, times)
        result = ttft_tpot_s(arrival, list(times))
        if not isinstance(result, tuple) or len(result) != 2:
            raise CheckFailed(f"{call_repr(name, args)} returned {result!r}; expected a tuple (ttft_s, tpot_s)")
        ttft, tpot = result
        want_ttft, want_tpot = reference_ttft_tpot_s(arrival, times)
        if is_close(ttft, times[0]) and not is_close(ttft, want_ttft):
            raise CheckFailed(f"{call_repr(name, args)} gave ttft_s={ttft:.4g}, expected {want_ttft:.4g}: "
                              "TTFT is measured from the request's arrival (arrival_s), not from time 0")
        expect_number(f"{name}(...)[0] (ttft_s)", args, ttft, want_ttft, "TTFT = time of the first token - arrival_s")
        if tpot is None:
            raise CheckFailed(f"{call_repr(name, args)} gave tpot_s=None, expected {want_tpot:.4g}: "
                              "there are several tokens, so there are gaps to average")
        n = len(times)
        if is_close(tpot, (times[-1] - arrival) / n) or is_close(tpot, (times[-1] - arrival) / (n - 1)):
            hint = "TPOT leaves the first token out: it averages the decode gaps only (the prefill is TTFT's job)"
        elif is_close(tpot, (times[-1] - times[0]) / n):
            hint = f"{n} tokens have {n - 1} gaps between them: divide by len(token_times_s) - 1"
        else:
            hint = "TPOT = (last token time - first token time) / (number of tokens - 1)"
        expect_number(f"{name}(...)[1] (tpot_s)", args, tpot, want_tpot, hint)
    ttft, tpot = ttft_tpot_s(1.0, [1.5])
    if tpot is not None:
        raise CheckFailed(f"{call_repr(name, (1.0, [1.5]))} gave tpot_s={tpot!r}, expected None: one token has no gap "
                          "after it, so TPOT is undefined (the engine reports None too)")
    passed(name, len(cases) + 1)


def check_arithmetic_intensity(arithmetic_intensity: Callable) -> None:
    """FLOPs per byte of weights read: 2 * params * tokens / (params * bytes_per_param)."""
    name = "arithmetic_intensity"
    cases = [(1, 7e9, 2), (1, 134.5e6, 4), (512, 7e9, 2), (64, 1e9, 0.5), (3, 2e9, 1)]
    for tokens, params, bpp in cases:
        args = (tokens, params, bpp)
        got = arithmetic_intensity(tokens, params, bpp)
        want = reference_arithmetic_intensity(tokens, params, bpp)
        if is_close(got, want / 2):
            hint = "each weight does a multiply AND an add per token: 2 FLOPs per parameter per token"
        elif is_close(got, 2 * params * tokens) or is_close(got, 2 * params * tokens * bpp):
            hint = "that is the FLOP count; intensity divides it by the bytes read (num_params * bytes_per_param)"
        elif is_close(got, 2 * tokens * bpp):
            hint = "divide by bytes_per_param: fewer bytes per weight means more FLOPs per byte"
        elif is_close(got, 2 / bpp) and tokens != 1:
            hint = "the weights are read once per step however many tokens it carries, so intensity grows with num_tokens"
        else:
            hint = "intensity = FLOPs / bytes = (2 * num_params * num_tokens) / (num_params * bytes_per_param)"
        expect_number(name, args, got, want, hint)
    passed(name, len(cases))


def check_roofline_time(roofline_time_s: Callable) -> None:
    """A step takes as long as the slower of its compute (flops / peak) and its memory traffic."""
    name = "roofline_time_s"
    cases = [
        (2e12, 1e9, 1e15, 1e12),         # compute-bound: 2 ms of math vs 1 ms of memory
        (2.7e8, 5.4e8, 6.7e10, 1.7e10),  # SmolLM2 decode on a CPU: memory-bound
        (1e15, 1e9, 1e15, 3.35e12),      # compute-bound
        (1e9, 1e9, 1e9, 1e9),            # exactly at the ridge
    ]
    for flops, nbytes, peak, bw in cases:
        args = (flops, nbytes, peak, bw)
        got = roofline_time_s(*args)
        want = reference_roofline_time_s(*args)
        compute, memory = flops / peak, nbytes / bw
        if is_close(got, min(compute, memory)) and not is_close(compute, memory):
            hint = "the step cannot finish before its slowest part: use max, not min"
        elif is_close(got, compute + memory):
            hint = ("compute and memory traffic overlap (the roofline assumes perfect overlap), so the time is "
                    "the max of the two, not their sum")
        elif is_close(got, flops / bw) or is_close(got, nbytes / peak):
            hint = "FLOPs go with peak FLOP/s and bytes go with bandwidth (bytes/s)"
        else:
            hint = "time = max(flops / peak_flops_per_s, bytes_moved / bandwidth_bytes_per_s)"
        expect_number(name, args, got, want, hint)
    passed(name, len(cases))


def check_decode_bandwidth_bound(decode_bandwidth_bound_tokens_per_s: Callable) -> None:
    """Batch-1 decode reads every weight once per token: tokens/s <= bandwidth / weight bytes."""
    name = "decode_bandwidth_bound_tokens_per_s"
    cases = [(7e9, 2, 1e12), (6.74e9, 2, 3.35e12), (134.5e6, 4, 16.8e9), (70e9, 0.5, 2e12)]
    for params, bpp, bw in cases:
        args = (params, bpp, bw)
        got = decode_bandwidth_bound_tokens_per_s(*args)
        want = reference_decode_bandwidth_bound_tokens_per_s(*args)
        if is_close(got, bw / params):
            hint = "a decode step reads every weight once — did you forget bytes_per_param?"
        elif is_close(got, params * bpp / bw):
            hint = "that is seconds per token (bytes / bandwidth); tokens per second is its inverse"
        elif is_close(got, bw / (2 * params)) or is_close(got, bw / (2 * params * bpp)):
            hint = "count bytes, not FLOPs: one decode step moves num_params * bytes_per_param bytes"
        elif is_close(got, bw * bpp / params):
            hint = "weights take num_params * bytes_per_param bytes: multiply by bytes_per_param, don't divide"
        else:
            hint = "tokens/s = bandwidth_bytes_per_s / (num_params * bytes_per_param)"
        expect_number(name, args, got, want, hint)
    passed(name, len(cases))


# ------------------------------------------------------------------ figures
def ttft_figure(rows: Sequence[dict], device: str) -> go.Figure:
    """TTFT vs prompt length, with the line TTFT would follow if it grew in proportion to the
    prompt from the shortest one measured."""
    fig = new_figure("Time to first token vs prompt length", "prompt tokens", "TTFT (ms)", device=device)
    xs = [r["prompt_tokens"] for r in rows]
    ys = [r["ttft_s"] * 1e3 for r in rows]
    fig.add_scatter(
        x=xs, y=ys, mode="lines+markers", name="measured TTFT",
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
            f"<p>Decode becomes compute-bound at a batch of about {self.ridge_batch():.0f}.</p>"
        )

    def ridge_batch(self) -> float:
        """The decode batch at which the intensity reaches the ridge point (peak / bandwidth)."""
        peak, bandwidth = self.devices[self.device_dropdown.value]
        per_token = self.arithmetic_intensity(1, self.models[self.model_dropdown.value], self.dtypes[self.dtype_dropdown.value])
        return (peak / bandwidth) / per_token if per_token > 0 else math.inf


def devices_with_this_one(peak_flops_per_s: float, bandwidth_bytes_per_s: float, device: str) -> dict[str, tuple[float, float]]:
    """This device's measured numbers first, then the reference accelerators."""
    return {f"this device, measured ({device})": (peak_flops_per_s, bandwidth_bytes_per_s), **REFERENCE_DEVICES}
