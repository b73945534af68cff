"""Lab 00 and the shared lab helpers: checks teach, the doctor table, the time breakdown
figure, and the latency slider's callback."""

from __future__ import annotations

from types import SimpleNamespace

import plotly.graph_objects as go
import pytest

from minillm.lab import common, lab00
from minillm.lab.common import CheckFailed

DEVICE = "cpu: Test CPU (2 threads)"


# ------------------------------------------------------------------ common
def test_quick_mode_reads_the_environment(monkeypatch):
    monkeypatch.setenv("MINILLM_QUICK", "1")
    assert common.quick_mode() is True
    monkeypatch.setenv("MINILLM_QUICK", "0")
    assert common.quick_mode() is False
    monkeypatch.delenv("MINILLM_QUICK")
    assert common.quick_mode() is False


@pytest.mark.parametrize(
    "value, unit, text",
    [(16.8e9, "B/s", "16.8 GB/s"), (989e12, "FLOP/s", "989 TFLOP/s"), (538e6, "B", "538 MB"), (12.0, "tokens/s", "12 tokens/s"),
     (0.5, "", "0.5"), (2500, "B", "2.5 kB")],
)
def test_format_si(value, unit, text):
    assert common.format_si(value, unit) == text


@pytest.mark.parametrize("seconds, text", [(2.5, "2.5 s"), (0.0123, "12.3 ms"), (4.2e-5, "42 µs"), (float("nan"), "n/a")])
def test_format_seconds(seconds, text):
    assert common.format_seconds(seconds) == text


def test_new_figure_says_which_device_and_can_be_a_widget():
    fig = common.new_figure("t", "x", "y", device=DEVICE, log_x=True)
    assert isinstance(fig, go.Figure) and not isinstance(fig, go.FigureWidget)
    assert common.figure_subtitle(fig) == f"measured on {DEVICE}"
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type != "log"
    widget = common.new_figure("t", "x", "y", widget=True)
    assert isinstance(widget, go.FigureWidget) and common.figure_subtitle(widget) == ""


class WordTokenizer:
    """One id per word (its length); a BOS id 0 with special tokens."""

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [len(word) for word in text.split()]


def test_prompt_token_ids_has_the_exact_length():
    tok = WordTokenizer()
    assert common.prompt_token_ids(tok, 1) == [0]
    ids = common.prompt_token_ids(tok, 500)
    assert len(ids) == 500 and ids[0] == 0 and ids[1:4] == [3, 10, 6]  # "The lighthouse keeper"
    with pytest.raises(ValueError, match="num_tokens=0 must be >= 1"):
        common.prompt_token_ids(tok, 0)


def test_time_call_and_stopwatch():
    calls = []
    seconds = common.time_call(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and 0 <= seconds < 0.1
    with common.Stopwatch() as sw:
        pass
    assert 0 <= sw.seconds < 0.1
    with pytest.raises(ValueError, match="reduce='mean'"):
        common.time_call(lambda: None, reduce="mean")


# ------------------------------------------------------------------ checks
def test_checks_accept_correct_solutions(passes):
    assert passes(lab00.check_tokens_per_second, lambda n, s: n / s if s > 0 else (_ for _ in ()).throw(ValueError(s)))
    assert passes(lab00.check_e2e_latency, lambda ttft, tpot, n: ttft + tpot * (n - 1)) == "✓ e2e_latency_s: all 4 cases pass"
    tok = WordTokenizer()
    assert passes(lab00.check_count_tokens, lambda t, text: len(t.encode(text)), tok).endswith("all 5 cases pass")


def test_check_tokens_per_second_teaches():
    with pytest.raises(CheckFailed, match=r"tokens_per_second\(100, 2.0\) returned 0.02, expected 50: that is seconds per token"):
        lab00.check_tokens_per_second(lambda n, s: s / n)
    with pytest.raises(CheckFailed, match="raised ZeroDivisionError; raise a ValueError"):
        lab00.check_tokens_per_second(lambda n, s: n / s)
    with pytest.raises(CheckFailed, match=r"tokens_per_second\(10, -1.0\) returned -10.0; a duration must be > 0"):
        lab00.check_tokens_per_second(lambda n, s: n / s if s != 0 else (_ for _ in ()).throw(ValueError(s)))


def test_check_e2e_latency_teaches():
    with pytest.raises(CheckFailed, match=r"returned 1.05, expected 1: off by one token"):
        lab00.check_e2e_latency(lambda ttft, tpot, n: ttft + tpot * n)
    with pytest.raises(CheckFailed, match="add the time to the first token"):
        lab00.check_e2e_latency(lambda ttft, tpot, n: tpot * n)


def test_check_count_tokens_teaches():
    tok = WordTokenizer()
    with pytest.raises(CheckFailed, match=r"returned 11, expected 3: that is the number of characters"):
        lab00.check_count_tokens(lambda t, text: len(text), tok)
    with pytest.raises(CheckFailed, match="expected an int"):
        lab00.check_count_tokens(lambda t, text: float(len(t.encode(text))), tok)


def test_check_count_tokens_spots_words_with_a_real_tokenizer(default_llm, passes):
    with pytest.raises(CheckFailed, match="that is the number of words"):
        lab00.check_count_tokens(lambda t, text: len(text.split()), default_llm.tokenizer)
    assert passes(lab00.check_count_tokens, lambda t, text: len(t.encode(text)), default_llm.tokenizer)


# ------------------------------------------------------------------ doctor
def test_doctor_html_marks_problems():
    page = lab00.doctor_html([("python", True, "3.11"), ("default model answers", False, "run `minillm model` <now>")])
    assert page.count("✅") == 1 and page.count("❌") == 1
    assert "&lt;now&gt;" in page and "1 problem(s): default model answers" in page
    assert "All good" in lab00.doctor_html([("python", True, "3.11")])


def test_fallback_doctor_without_the_model():
    checks = lab00._fallback_doctor(load_model=False)
    names = [name for name, _, _ in checks]
    assert names[:3] == ["python", "torch", "device"] and all(ok for _, ok, _ in checks)


# ------------------------------------------------------------------ where the time goes
METRICS = SimpleNamespace(queue_s=0.01, ttft_s=0.51, tpot_s=0.1, e2e_s=2.01, num_prompt_tokens=10, num_output_tokens=16)


def test_time_breakdown_and_figure():
    parts = lab00.time_breakdown(METRICS)
    assert parts["queue_s"] == 0.01 and parts["prefill_s"] == pytest.approx(0.5) and parts["decode_s"] == pytest.approx(1.5)
    fig = lab00.breakdown_figure(METRICS, DEVICE)
    assert [list(trace.x) for trace in fig.data] == [[0.01], [pytest.approx(0.5)], [pytest.approx(1.5)]]
    assert fig.data[2].name == "decode: 15 more tokens, one per step"
    assert fig.layout.barmode == "stack" and DEVICE in common.figure_subtitle(fig)


def test_latency_explorer_slider_updates_the_bars():
    explorer = lab00.LatencyExplorer(0.5, 0.1, lambda ttft, tpot, n: ttft + tpot * (n - 1), DEVICE)
    assert explorer.slider.value == 16 and list(explorer.figure.data[1].x) == [pytest.approx(1.5)]
    explorer.slider.value = 101
    assert list(explorer.figure.data[0].x) == [0.5]
    assert list(explorer.figure.data[1].x) == [pytest.approx(10.0)]
    assert "101 output tokens: 10.50 s" in explorer.figure.layout.title.text
    assert "decode is 95% of it" in explorer.readout.value


def test_latency_explorer_waits_for_the_exercise():
    def unfinished(*args):
        raise NotImplementedError()

    explorer = lab00.LatencyExplorer(0.5, 0.1, unfinished, DEVICE)
    explorer.slider.value = 40
    assert "Write e2e_latency_s" in explorer.readout.value
    assert list(explorer.figure.data[1].x) == [0.0]


def test_as_widget_keeps_traces_in_the_initial_state():
    fig = common.new_figure("t", "x", "y")
    fig.add_scatter(x=[1, 2, 3], y=[4, 5, 6], name="line")
    widget = common.as_widget(fig)
    assert isinstance(widget, go.FigureWidget)
    assert list(widget._widget_data[0]["x"]) == [1, 2, 3] and widget.layout.xaxis.title.text == "x"
    explorer = lab00.LatencyExplorer(0.5, 0.1, lambda ttft, tpot, n: ttft + tpot * (n - 1), DEVICE)
    assert [trace["name"] for trace in explorer.figure._widget_data] == ["TTFT", "decode"]
