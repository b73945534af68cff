"""Lab 01 helpers: the check_* functions catch the usual mistakes with the right hint, the
figures carry the numbers and the device, and the explorer's callbacks move the points."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import plotly.graph_objects as go
import pytest

from lab_utils import assert_check_fails, notebook_functions, run_solution_cells

from grading.build import SOURCE_DIR
from minillm.lab import common, lab01
from minillm.lab.common import CheckFailed

DEVICE = "cpu: Test CPU (2 threads)"
MASTER = SOURCE_DIR / "01_prefill_decode" / "01_prefill_decode.ipynb"


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The measurements the master notebook defines, as the learner reads them."""
    return notebook_functions(MASTER, "measure_decode", "token_times_from_metrics", "measured_points")


# ------------------------------------------------------------------ checks accept the references
def test_checks_accept_the_reference_solutions(capsys, passes):
    assert passes(lab01.check_ttft_tpot, lab01.reference_ttft_tpot_s) == "✓ ttft_tpot_s: all 4 cases pass"
    assert passes(lab01.check_arithmetic_intensity, lab01.reference_arithmetic_intensity).endswith("all 5 cases pass")
    assert passes(lab01.check_roofline_time, lab01.reference_roofline_time_s).endswith("all 4 cases pass")
    assert passes(lab01.check_decode_bandwidth_bound, lab01.reference_decode_bandwidth_bound_tokens_per_s).endswith("all 4 cases pass")
    assert capsys.readouterr().out.count("✓") == 4


def test_reference_values_match_the_course_examples():
    # "a 7B model in fp16 is 14 GB; at 1 TB/s that is about 70 tokens/s"
    assert lab01.reference_decode_bandwidth_bound_tokens_per_s(7e9, 2, 1e12) == pytest.approx(71.428, rel=1e-4)
    assert lab01.reference_decode_bandwidth_bound_tokens_per_s(6.74e9, 2, 3.35e12) == pytest.approx(248.52, rel=1e-4)
    assert lab01.reference_arithmetic_intensity(1, 134.5e6, 4) == 0.5
    assert lab01.reference_arithmetic_intensity(512, 7e9, 2) == 512
    assert lab01.reference_roofline_time_s(2e12, 1e9, 1e15, 1e12) == pytest.approx(2e-3)
    assert lab01.reference_ttft_tpot_s(10.0, [10.5, 10.6, 10.7, 10.9]) == (0.5, pytest.approx(0.4 / 3))
    assert lab01.reference_ttft_tpot_s(1.0, [1.5]) == (0.5, None)


# ------------------------------------------------------------------ checks teach
@pytest.mark.parametrize(
    "wrong, expected_message",
    [
        (lambda p, b, bw: bw / p,
         "decode_bandwidth_bound_tokens_per_s(7e+09, 2, 1e+12) returned 142.9, expected 71.43: a decode step reads "
         "every weight once — did you forget bytes_per_param?"),
        (lambda p, b, bw: p * b / bw, "that is seconds per token"),
        (lambda p, b, bw: bw / (2 * p * b), "count bytes, not FLOPs"),
        (lambda p, b, bw: bw * b / p, "multiply by bytes_per_param, don't divide"),
        (lambda p, b, bw: 1.0, "tokens/s = bandwidth_bytes_per_s / (num_params * bytes_per_param)"),
    ],
)
def test_check_decode_bandwidth_bound_names_the_mistake(wrong, expected_message):
    with pytest.raises(CheckFailed) as failure:
        lab01.check_decode_bandwidth_bound(wrong)
    assert expected_message in str(failure.value)


@pytest.mark.parametrize(
    "wrong, expected_hint",
    [
        (lambda t, p, b: t / b, "2 FLOPs per parameter per token"),
        (lambda t, p, b: 2 * p * t, "that is the FLOP count"),
        (lambda t, p, b: 2 * t * b, "divide by bytes_per_param"),
        (lambda t, p, b: 2 / b, "intensity grows with num_tokens"),
    ],
)
def test_check_arithmetic_intensity_names_the_mistake(wrong, expected_hint):
    with pytest.raises(CheckFailed, match="arithmetic_intensity") as failure:
        lab01.check_arithmetic_intensity(wrong)
    assert expected_hint in str(failure.value)


@pytest.mark.parametrize(
    "wrong, expected_hint",
    [
        (lambda f, b, p, bw: min(f / p, b / bw), "use max, not min"),
        (lambda f, b, p, bw: f / p + b / bw, "not their sum"),
        (lambda f, b, p, bw: max(f / bw, b / p), "FLOPs go with peak FLOP/s"),
    ],
)
def test_check_roofline_time_names_the_mistake(wrong, expected_hint):
    with pytest.raises(CheckFailed) as failure:
        lab01.check_roofline_time(wrong)
    assert expected_hint in str(failure.value)


def test_check_roofline_time_reports_the_first_wrong_case():
    with pytest.raises(CheckFailed) as failure:
        lab01.check_roofline_time(lambda f, b, p, bw: min(f / p, b / bw))
    assert str(failure.value).startswith("roofline_time_s(2e+12, 1e+09, 1e+15, 1e+12) returned 0.001, expected 0.002")


@pytest.mark.parametrize(
    "wrong, expected_hint",
    [
        (lambda a, t: (t[0], None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)), "measured from the request's arrival"),
        (lambda a, t: (t[0] - a, (t[-1] - a) / len(t)), "leaves the first token out"),
        (lambda a, t: (t[0] - a, (t[-1] - t[0]) / len(t)), "divide by len(token_times_s) - 1"),
        (lambda a, t: (t[0] - a, None), "there are several tokens"),
        (lambda a, t: t[0] - a, "expected a tuple (ttft_s, tpot_s)"),
        (lambda a, t: (t[0] - a, (t[-1] - t[0]) / max(len(t) - 1, 1)), "one token has no gap"),
    ],
)
def test_check_ttft_tpot_names_the_mistake(wrong, expected_hint):
    with pytest.raises(CheckFailed) as failure:
        lab01.check_ttft_tpot(wrong)
    assert expected_hint in str(failure.value)


def test_checks_propagate_not_implemented():
    """An untouched exercise must fail its test cell (it scores 0), not pass silently."""
    def stub(*args):
        raise NotImplementedError()

    for check in (lab01.check_ttft_tpot, lab01.check_arithmetic_intensity, lab01.check_roofline_time,
                  lab01.check_decode_bandwidth_bound, lab01.check_arithmetic_intensity_more,
                  lab01.check_roofline_time_more, lab01.check_decode_bandwidth_bound_more):
        with pytest.raises(NotImplementedError):
            check(stub)
    with pytest.raises(NotImplementedError):
        lab01.check_ttft_tpot_engine(stub, SimpleNamespace(ttft_s=0.1, itl_s=[0.02], tpot_s=0.02))


def test_more_checks_accept_the_references(passes):
    assert passes(lab01.check_arithmetic_intensity_more,
                  lab01.reference_arithmetic_intensity).endswith("all 6 cases pass")
    assert passes(lab01.check_roofline_time_more, lab01.reference_roofline_time_s).endswith("all 4 cases pass")
    assert passes(lab01.check_decode_bandwidth_bound_more,
                  lab01.reference_decode_bandwidth_bound_tokens_per_s).endswith("all 4 cases pass")
    metrics = SimpleNamespace(ttft_s=0.05, itl_s=[0.02, 0.03], tpot_s=0.025)
    assert "✓" in passes(lab01.check_ttft_tpot_engine, lab01.reference_ttft_tpot_s, metrics)


def test_a_crash_in_the_learners_code_names_the_call():
    with pytest.raises(CheckFailed, match=r"ttft_tpot_s\(1.0, \[1.5\]\) raised ZeroDivisionError.*return None"):
        lab01.check_ttft_tpot(lambda a, t: (t[0] - a, (t[-1] - t[0]) / (len(t) - 1)))
    with pytest.raises(CheckFailed, match=r"arithmetic_intensity\(1, 7e\+09, 2\) raised KeyError"):
        lab01.check_arithmetic_intensity(lambda t, p, b: {}[t])


def test_ridge_batch_rounds_up_and_counts_the_tie_as_compute_bound():
    assert lab01.ridge_batch(989e12, 3.35e12, 6.74e9, 2) == 296  # ridge 295.2 FLOP/byte, 1 FLOP/byte per request
    assert lab01.ridge_batch(64e9, 16e9, 1e8, 4) == 8            # exactly 4 / 0.5: B = 8 is at the ridge
    assert lab01.ridge_batch(1e9, 1e9, 1e8, 1) == 1              # batch 1 already reaches it
    assert lab01.ridge_batch(989e12, 3.35e12, 6.74e9, 4) == 591


@pytest.mark.parametrize(
    "answer, hint",
    [(295, "rounded down"), (295.22, "whole number of requests"), (591, "0.5 is fp32"), (148, "1 FLOP/byte"),
     (1, "memory-bound region"), (None, "expected a whole number")],
)
def test_check_answer_ridge_batch_says_why(answer, hint):
    with pytest.raises(CheckFailed, match="answer_ridge_batch_h100") as failure:
        lab01.check_answer_ridge_batch_h100(answer)
    assert hint in str(failure.value)


def test_check_rejects_non_numbers():
    with pytest.raises(CheckFailed, match=r"returned '71' \(str\); expected a number"):
        lab01.check_decode_bandwidth_bound(lambda p, b, bw: "71")


# ------------------------------------------------------------------ measurements (fake engine)
class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [len(word) for word in text.split()]


class FakeLLM:
    """generate() returns TTFT = 1 ms per prompt token + 10 ms; decode steps of 20 ms."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.calls = []

    def generate(self, prompts, params):
        ids = prompts[0]["prompt_token_ids"]
        self.calls.append((len(ids), params.max_tokens))
        ttft = 0.010 + 0.001 * len(ids)
        itl = [0.020] * (params.max_tokens - 1)
        metrics = SimpleNamespace(ttft_s=ttft, tpot_s=0.020 if itl else None, itl_s=itl, e2e_s=ttft + sum(itl),
                                  num_output_tokens=params.max_tokens, num_prompt_tokens=len(ids))
        return [SimpleNamespace(metrics=metrics)]


def test_time_ttft_check_passes_the_solution_and_prefill_runs_the_engine(default_llm, passes, graded_namespace):
    time_ttft = graded_namespace["time_ttft"]
    assert passes(lab01.check_time_ttft, time_ttft).startswith("✓ time_ttft: all 3")
    prefill = lab01.Prefill(default_llm)
    timing = time_ttft(prefill, [24, 8], warmup=1, repeats=2)
    assert prefill.calls == 6 and [r["prompt_tokens"] for r in timing["rows"]] == [24, 8]
    assert all(r["min"] <= r["median"] <= r["max"] for r in timing["rows"])
    assert timing["ratio"] == pytest.approx(timing["rows"][0]["median"] / timing["rows"][1]["median"])
    assert default_llm.stats.num_prompt_tokens == 8   # the last request: 8 prompt tokens, prefilled
    with pytest.raises(ValueError, match="num_tokens=0"):
        prefill(0)
    rows = lab01.ttft_rows_from_timing(timing)
    assert rows[1]["prefill_tokens_per_s"] == pytest.approx(8 / timing["rows"][1]["median"])
    fig = lab01.ttft_figure(rows, DEVICE)
    assert list(fig.data[0].error_y.array) == pytest.approx([(r["max_s"] - r["ttft_s"]) * 1e3 for r in rows])


def test_print_ttft_timing_shows_the_reference(capsys):
    timing = {"rows": [{"prompt_tokens": 16, "median": 0.05, "min": 0.04, "max": 0.09},
                       {"prompt_tokens": 256, "median": 0.4, "min": 0.38, "max": 0.5}], "ratio": 8.0}
    lab01.print_ttft_timing(timing)
    out = capsys.readouterr().out
    assert "TTFT(256) / TTFT(16): yours 8x" in out and lab01.REFERENCE_HARDWARE in out


def test_measure_decode_and_token_times(experiments):
    measure_decode, token_times_from_metrics = experiments["measure_decode"], experiments["token_times_from_metrics"]
    decode = measure_decode(FakeLLM(), num_tokens=5, prompt_tokens=16)
    assert decode["tpot_s"] == 0.020 and decode["tokens_per_s"] == pytest.approx(50.0)
    assert decode["itl_s"] == [0.020] * 4 and decode["output_tokens"] == 5
    arrival, times = token_times_from_metrics(decode["metrics"])
    assert arrival == 0.0 and times == pytest.approx([0.026, 0.046, 0.066, 0.086, 0.106])
    assert lab01.reference_ttft_tpot_s(arrival, times) == (pytest.approx(0.026), pytest.approx(0.020))
    with pytest.raises(ValueError, match="num_tokens=1 must be >= 2"):
        measure_decode(FakeLLM(), num_tokens=1)


def test_measure_on_the_real_engine(default_llm, experiments):
    decode = experiments["measure_decode"](default_llm, num_tokens=3, prompt_tokens=8)
    assert decode["output_tokens"] == 3 and len(decode["itl_s"]) == 2
    assert decode["tokens_per_s"] == pytest.approx(1 / decode["tpot_s"])
    arrival, times = experiments["token_times_from_metrics"](decode["metrics"])
    assert lab01.reference_ttft_tpot_s(arrival, times)[1] == pytest.approx(decode["metrics"].tpot_s)


# ------------------------------------------------------------------ figures
TTFT_ROWS = [
    {"prompt_tokens": 16, "ttft_s": 0.1, "prefill_tokens_per_s": 160.0},
    {"prompt_tokens": 64, "ttft_s": 0.2, "prefill_tokens_per_s": 320.0},
]


def test_ttft_figure_plots_ms_and_the_proportional_line():
    fig = lab01.ttft_figure(TTFT_ROWS, DEVICE)
    assert list(fig.data[0].x) == [16, 64] and list(fig.data[0].y) == pytest.approx([100.0, 200.0])
    assert list(fig.data[1].y) == pytest.approx([100.0, 400.0])  # 6.25 ms per token, in proportion
    assert common.figure_subtitle(fig) == f"measured on {DEVICE}"


def test_decode_and_bound_figures():
    decode = {"itl_s": [0.02, 0.03], "tpot_s": 0.025, "tokens_per_s": 40.0}
    fig = lab01.decode_steps_figure(decode, DEVICE)
    assert list(fig.data[0].y) == pytest.approx([20.0, 30.0]) and list(fig.data[0].x) == [2, 3]
    assert "40.0 tokens/s" in fig.layout.title.text
    bound = lab01.bound_figure(2.0, 8.0, DEVICE)
    assert list(bound.data[0].y) == [8.0, 2.0]
    assert bound.layout.title.text == "Decode at batch 1 reaches 25% of the bandwidth bound"
    assert DEVICE in common.figure_subtitle(bound)


def test_roofline_figure_roof_and_grouped_points(experiments):
    points = experiments["measured_points"](TTFT_ROWS, {"tpot_s": 0.5}, num_params=1e8, bytes_per_param=4)
    assert points[0]["intensity"] == 0.5 and points[0]["flops_per_s"] == pytest.approx(4e8)
    assert points[2]["intensity"] == 32 and points[2]["flops_per_s"] == pytest.approx(2e8 * 64 / 0.2)
    fig = lab01.roofline_figure(64e9, 16e9, DEVICE, points)
    roof = dict(zip(fig.data[0].x, fig.data[0].y))
    assert roof[1.0] == pytest.approx(16e9) and roof[4.0] == pytest.approx(64e9) and roof[256.0] == pytest.approx(64e9)
    assert [trace.name for trace in fig.data[1:]] == ["measured decode", "measured prefill"]
    assert list(fig.data[2].x) == [8.0, 32.0]
    assert "ridge at 4 FLOP/byte" in fig.layout.title.text
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"


def test_measured_points_use_the_learners_intensity(experiments):
    points = experiments["measured_points"](TTFT_ROWS, {"tpot_s": 0.5}, 1e8, 4, arithmetic_intensity=lambda t, p, b: 10 * t)
    assert [p["intensity"] for p in points] == [10, 160, 640]


# ------------------------------------------------------------------ the explorer widget
DEVICES = {"test cpu": (64e9, 16e9), "big gpu": (1000e12, 4e12)}
MODELS = {"tiny": 1e8, "7B": 7e9}


def make_explorer(**kwargs):
    return lab01.RooflineExplorer(DEVICES, MODELS, device="test cpu", model="tiny", dtype="fp32", **kwargs)


def test_explorer_starts_at_batch_1_and_prompt_256():
    explorer = make_explorer()
    fig = explorer.figure
    assert isinstance(fig, go.FigureWidget)
    assert list(fig.data[1].x) == [0.5] and list(fig.data[1].y) == pytest.approx([8e9])  # 0.5 FLOP/B x 16 GB/s
    assert list(fig.data[2].x) == [128.0] and list(fig.data[2].y) == pytest.approx([64e9])  # compute-bound
    assert "memory-bound" in explorer.readout.value and "compute-bound" in explorer.readout.value
    assert explorer.ridge_batch() == pytest.approx(8.0)
    assert "batch of about 8" in explorer.readout.value


def test_batch_slider_moves_the_decode_point():
    explorer = make_explorer()
    before = explorer.readout.value
    explorer.batch_slider.value = 4
    assert list(explorer.figure.data[1].x) == [2.0]
    assert list(explorer.figure.data[1].y) == pytest.approx([32e9])
    assert list(explorer.figure.data[1].text) == ["decode B=4"]
    assert explorer.readout.value != before and "decode, batch 4" in explorer.readout.value
    explorer.batch_slider.value = 64  # past the ridge (8): capped at the peak
    assert list(explorer.figure.data[1].y) == pytest.approx([64e9])
    assert explorer.operating_point(64)["bound"] == "compute-bound"


def test_prompt_slider_moves_the_prefill_point():
    explorer = make_explorer()
    explorer.prompt_slider.value = 16
    assert list(explorer.figure.data[2].x) == [8.0]
    assert explorer.operating_point(16)["seconds"] == pytest.approx(2 * 1e8 * 16 / 64e9)


def test_device_model_and_dtype_dropdowns_change_roof_and_bound():
    explorer = make_explorer()
    roof_before = list(explorer.figure.data[0].y)
    explorer.device_dropdown.value = "big gpu"
    assert list(explorer.figure.data[0].y) != roof_before
    assert max(explorer.figure.data[0].y) == pytest.approx(1000e12)
    assert "big gpu" in explorer.figure.layout.title.subtitle.text
    explorer.model_dropdown.value = "7B"
    explorer.dtype_dropdown.value = "bf16 / fp16"
    decode = explorer.operating_point(1)
    assert decode["tokens_per_s"] == pytest.approx(4e12 / 14e9)  # the bandwidth bound
    assert list(explorer.figure.data[1].x) == [1.0]
    assert explorer.ridge_batch() == pytest.approx(250.0)
    assert explorer.figure.layout.title.text.startswith("7B (bf16 / fp16)")


def test_explorer_uses_the_learners_functions_and_falls_back_to_the_reference():
    calls = []

    def intensity(t, p, b):
        calls.append(t)
        return 3.0 * t

    explorer = make_explorer(arithmetic_intensity=intensity)
    explorer.batch_slider.value = 2
    assert list(explorer.figure.data[1].x) == [6.0] and 2 in calls and explorer.note == ""

    def unfinished(*args):
        raise NotImplementedError()

    fallback = make_explorer(arithmetic_intensity=unfinished, roofline_time_s=unfinished)
    assert list(fallback.figure.data[1].x) == [0.5]
    assert "arithmetic_intensity (exercise 3) is not written yet" in fallback.readout.value
    assert "roofline_time_s (exercise 4) is not written yet" in fallback.note


def test_measured_points_show_only_on_their_device():
    points = [{"name": "m", "label": "decode B=1", "intensity": 0.5, "flops_per_s": 1e9}]
    explorer = make_explorer(measured_points={"test cpu": points})
    assert list(explorer.figure.data[3].x) == [0.5] and list(explorer.figure.data[3].text) == ["decode B=1"]
    explorer.device_dropdown.value = "big gpu"
    assert list(explorer.figure.data[3].x) == []


def test_devices_with_this_one_puts_the_measured_device_first():
    devices = lab01.devices_with_this_one(50e9, 10e9, DEVICE)
    first = next(iter(devices))
    assert first == f"this device, measured ({DEVICE})" and devices[first] == (50e9, 10e9)
    assert devices["NVIDIA H100 SXM (bf16)"] == (989e12, 3.35e12)


def test_the_first_slider_is_an_int_slider():
    """The browser smoke test presses ArrowRight on the first slider of lab 01."""
    import ipywidgets as widgets

    explorer = make_explorer()
    assert isinstance(explorer.widget.children[0], widgets.IntSlider)
    assert explorer.widget.children[4] is explorer.figure


def test_explorer_figure_holds_every_trace_from_construction():
    """A FigureWidget inside a VBox renders the state it was built with; traces added later
    can lose data in JupyterLab, so the explorer's widget must be born complete."""
    explorer = make_explorer()
    initial = explorer.figure._widget_data
    assert [trace["name"] for trace in initial] == [trace.name for trace in explorer.figure.data]
    assert len(initial[0]["x"]) == len(lab01.ROOF_INTENSITIES) == len(initial[0]["y"])
    assert lab01.roofline_figure(1e9, 1e9, DEVICE, widget=True)._widget_data[0]["x"][0] == lab01.ROOF_INTENSITIES[0]


def _record_figure_messages(fig):
    messages = []
    fig.observe(lambda change: messages.append(change.new) if change.new is not None else None,
                names=["_py2js_update", "_py2js_restyle", "_py2js_relayout"])
    return messages


def test_explorer_updates_never_send_undefined_trace_properties():
    """A restyle that sets x for some traces and leaves it undefined for others made plotly.js
    drop the roof's x in JupyterLab (the roof was drawn against point indexes)."""
    from plotly.basedatatypes import Undefined

    explorer = make_explorer(measured_points={"test cpu": [{"name": "m", "intensity": 0.5, "flops_per_s": 1e9}]})
    messages = _record_figure_messages(explorer.figure)
    explorer.device_dropdown.value = "big gpu"
    explorer.batch_slider.value = 3
    explorer.model_dropdown.value = "7B"
    assert messages, "the callbacks sent nothing to the frontend"
    for message in messages:
        style = message.get("style_data") or message.get("restyle_data") or {}
        for prop, per_trace in style.items():
            values = per_trace if isinstance(per_trace, list) else [per_trace]
            assert all(v is not Undefined and v != "_undefined_" for v in values), (prop, message)
    assert list(explorer.figure.data[0].x) == lab01.ROOF_INTENSITIES


# ------------------------------------------------------------------ wrong answers fail the graded cells (issue 27)
class VariedLLM(FakeLLM):
    """FakeLLM whose decode steps vary: one of them slowed down by another program, so mean != median."""

    STEPS_S = [0.030, 0.031, 0.029, 0.090, 0.030, 0.032, 0.028, 0.031]

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        metrics = out[0].metrics
        metrics.itl_s = [self.STEPS_S[i % len(self.STEPS_S)] for i in range(params.max_tokens - 1)]
        metrics.tpot_s = statistics.fmean(metrics.itl_s) if metrics.itl_s else None
        metrics.e2e_s = metrics.ttft_s + sum(metrics.itl_s)
        return out


@pytest.fixture(scope="module")
def graded_namespace() -> dict:
    """The state the graded cells read, built cheaply: part 1's experiments run on fake engines (the full run's
    eight prompt lengths, so the 256-token row is not the last; decode steps with one slow step), this device's
    numbers made up, and the master's solution cells run over it."""
    fns = notebook_functions(MASTER, "measure_decode", "token_times_from_metrics")
    num_params, bytes_per_param = 134.5e6, 4.0
    namespace = {
        "lab01": lab01, "common": common, "math": math, "statistics": statistics, "time": __import__("time"),
        "DEVICE": DEVICE, "NUM_PARAMS": num_params, "BYTES_PER_PARAM": bytes_per_param,
        "llm": SimpleNamespace(weight_bytes=num_params * bytes_per_param),
        "bandwidth": 20e9, "peak_flops": 200e9,
        "decode": fns["measure_decode"](VariedLLM(), num_tokens=9),
        "token_times_from_metrics": fns["token_times_from_metrics"],
        "predicted_ttft_ratio_256_vs_16": 16, "predicted_decode_step_ms": None,
    }
    return run_solution_cells(MASTER, namespace)


_TIME_TTFT = """
import statistics, time
def time_ttft(prefill, prompt_lengths, clock=time.perf_counter, warmup=1, repeats=3):
    rows = []
    for n in prompt_lengths:
        samples = []
        for i in range(warmup + repeats):
            start = {read}
            prefill(n)
            elapsed = {read} - start
            if {keep}:
                samples.append(elapsed)
        rows.append({{"prompt_tokens": n, "median": {stat}(samples), "min": min(samples), "max": max(samples)}})
    by_length = {{row["prompt_tokens"]: row["median"] for row in rows}}
    return {{"rows": rows, "ratio": {ratio}}}
"""


def _time_ttft(read="clock()", keep="i >= warmup", stat="statistics.median",
               ratio="by_length[max(by_length)] / by_length[min(by_length)]"):
    return _TIME_TTFT.format(read=read, keep=keep, stat=stat, ratio=ratio)


MISTAKES = {
    "test_measure_ttft_timing": [
        (_time_ttft(keep="True"), "warm-up included"),
        (_time_ttft(stat="statistics.fmean"), "the mean"),
        (_time_ttft(stat="min"), "the minimum"),
        (_time_ttft(ratio="by_length[min(by_length)] / by_length[max(by_length)]"), "upside down"),
        (_time_ttft(ratio='rows[-1]["median"] / rows[0]["median"]'), "the last row over the first"),
        (_time_ttft(read="time.perf_counter()"), "never read `clock`"),
    ],
    "test_ttft_tpot": [
        ("def ttft_tpot_s(a, t):\n    return t[0], (None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1))",
         "ttft_tpot_s(10.0, [10.5, 10.6, 10.7, 10.9])"),
        ("def ttft_tpot_s(a, t):\n    return t[0] - a, (None if len(t) < 2 else (t[-1] - t[0]) / len(t))",
         "ttft_tpot_s(10.0, [10.5, 10.6, 10.7, 10.9])"),
        ("def ttft_tpot_s(a, t):\n    return t[0] - a, (t[-1] - t[0]) / (len(t) - 1)", "ttft_tpot_s(1.0, [1.5])"),
        ("def ttft_tpot_s(a, t):\n    return t[0] - a, (t[-1] - a) / len(t)", "ttft_tpot_s(10.0, [10.5, 10.6, 10.7, 10.9])"),
    ],
    "test_ttft_tpot_engine": [
        ("def ttft_tpot_s(a, t):\n    return t[0], (None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1))",
         "the request measured in part 1"),
        ("def ttft_tpot_s(a, t):\n    return t[0] - a, (None if len(t) < 2 else (t[-1] - t[0]) / len(t))",
         "the request measured in part 1"),
        ("def ttft_tpot_s(a, t):\n    return t[0] - a, (None if len(t) < 2 else (t[-1] - a) / len(t))",
         "the request measured in part 1"),
    ],
    "test_decode_bandwidth_bound": [
        ("def decode_bandwidth_bound_tokens_per_s(p, b, bw):\n    return bw / p",
         "decode_bandwidth_bound_tokens_per_s(7e+09, 2, 1e+12)"),
        ("def decode_bandwidth_bound_tokens_per_s(p, b, bw):\n    return p * b / bw",
         "decode_bandwidth_bound_tokens_per_s(7e+09, 2, 1e+12)"),
        ("def decode_bandwidth_bound_tokens_per_s(p, b, bw):\n    return bw / (2 * p * b)",
         "decode_bandwidth_bound_tokens_per_s(7e+09, 2, 1e+12)"),
    ],
    "test_decode_bandwidth_bound_more": [
        ("def decode_bandwidth_bound_tokens_per_s(p, b, bw):\n    return bw / p",
         "decode_bandwidth_bound_tokens_per_s(8.03e+09, 0.5, 4.8e+12)"),
        ("def decode_bandwidth_bound_tokens_per_s(p, b, bw):\n    return bw * b / p",
         "decode_bandwidth_bound_tokens_per_s(8.03e+09, 0.5, 4.8e+12)"),
        ("def decode_bandwidth_bound_tokens_per_s(p, b, bw):\n    return bw / (p * max(b, 1))",
         "decode_bandwidth_bound_tokens_per_s(8.03e+09, 0.5, 4.8e+12)"),
    ],
    "test_apply_bounds": [
        ('fraction_of_bound = engine_bound_tokens_per_s / decode["tokens_per_s"]', "fraction_of_bound"),
        ('fraction_of_bound = 100 * decode["tokens_per_s"] / engine_bound_tokens_per_s', "fraction_of_bound"),
        ("engine_bound_tokens_per_s = decode_bandwidth_bound_tokens_per_s(NUM_PARAMS, 2, bandwidth)",
         "engine_bound_tokens_per_s"),
        ("llama2_7b_h100_tokens_per_s = decode_bandwidth_bound_tokens_per_s(7e9, 2, 3.35e12)",
         "llama2_7b_h100_tokens_per_s"),
    ],
    "test_arithmetic_intensity": [
        ("def arithmetic_intensity(t, p, b):\n    return t / b", "arithmetic_intensity(1, 7e+09, 2)"),
        ("def arithmetic_intensity(t, p, b):\n    return 2 * p * t", "arithmetic_intensity(1, 7e+09, 2)"),
        ("def arithmetic_intensity(t, p, b):\n    return 2 / b", "arithmetic_intensity(512, 7e+09, 2)"),
    ],
    "test_arithmetic_intensity_more": [
        ("def arithmetic_intensity(t, p, b):\n    return t / b", "arithmetic_intensity(1, 6.74e+09, 2)"),
        ("def arithmetic_intensity(t, p, b):\n    return 2 * t * b", "arithmetic_intensity(1, 6.74e+09, 2)"),
        ("def arithmetic_intensity(t, p, b):\n    return 2 / b", "arithmetic_intensity(2048, 1e+09, 2)"),
    ],
    "test_roofline_time": [
        ("def roofline_time_s(f, b, p, bw):\n    return min(f / p, b / bw)", "roofline_time_s(2e+12, 1e+09, 1e+15, 1e+12)"),
        ("def roofline_time_s(f, b, p, bw):\n    return f / p + b / bw", "roofline_time_s(2e+12, 1e+09, 1e+15, 1e+12)"),
        ("def roofline_time_s(f, b, p, bw):\n    return max(f / bw, b / p)", "roofline_time_s(2e+12, 1e+09, 1e+15, 1e+12)"),
    ],
    "test_roofline_time_more": [
        ("def roofline_time_s(f, b, p, bw):\n    return min(f / p, b / bw)",
         "roofline_time_s(1.35e+10, 1.35e+10, 9.89e+14, 3.35e+12)"),
        ("def roofline_time_s(f, b, p, bw):\n    return f / p + b / bw",
         "roofline_time_s(1.35e+10, 1.35e+10, 9.89e+14, 3.35e+12)"),
        ("def roofline_time_s(f, b, p, bw):\n    return max(f / bw, b / p)", "roofline_time_s(0, 5e+08, 1e+12, 1e+10)"),
    ],
    "test_answer_ridge_batch_h100": [
        ("answer_ridge_batch_h100 = math.floor((989e12 / 3.35e12) / arithmetic_intensity(1, 6.74e9, 2))",
         "answer_ridge_batch_h100"),
        ("answer_ridge_batch_h100 = (989e12 / 3.35e12) / arithmetic_intensity(1, 6.74e9, 2)", "answer_ridge_batch_h100"),
        ("answer_ridge_batch_h100 = math.ceil((989e12 / 3.35e12) / arithmetic_intensity(1, 6.74e9, 4))",
         "answer_ridge_batch_h100"),
        ("answer_ridge_batch_h100 = math.ceil(arithmetic_intensity(1, 6.74e9, 2) / (989e12 / 3.35e12))",
         "answer_ridge_batch_h100"),
    ],
}


@pytest.mark.parametrize(
    "grade_id, mistake, names_the_case",
    [(grade_id, mistake, case) for grade_id, cases in MISTAKES.items() for mistake, case in cases],
)
def test_graded_cells_fail_on_plausible_mistakes(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)
