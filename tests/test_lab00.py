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


# ------------------------------------------------------------------ wrong answers (the rubric of grading/README.md)
from pathlib import Path  # noqa: E402

from lab_utils import assert_check_fails, run_solution_cells  # noqa: E402

MASTER = Path(__file__).resolve().parents[1] / "grading" / "source" / "00_setup" / "00_setup.ipynb"
# A request the engine could have measured: 12 prompt tokens, 8 output tokens, TTFT 0.3 s, TPOT 0.05 s.
FAKE_METRICS = SimpleNamespace(num_prompt_tokens=12, num_output_tokens=8, ttft_s=0.3, tpot_s=0.05, e2e_s=0.3 + 7 * 0.05,
                               queue_s=0.0)

MISTAKES = {
    "test_count_tokens": [
        ("def count_tokens(tokenizer, text):\n    return len(text)", "count_tokens(tokenizer, 'Hello world')"),
        ("def count_tokens(tokenizer, text):\n    return len(text.split()) + 1", "count_tokens(tokenizer,"),
        ("def count_tokens(tokenizer, text):\n    return tokenizer.encode(text).size", "raised AttributeError"),
    ],
    "test_count_tokens_engine": [
        ("def count_tokens(tokenizer, text):\n    return len(text)", "count_tokens(tokenizer, 'The capital of France is')"),
        ("def count_tokens(tokenizer, text):\n    return len(tokenizer.encode(text)) - 1", "the engine fed"),
        ("def count_tokens(tokenizer, text):\n    return len(text.split())", "count_tokens(tokenizer, 'tokens tokens"),
    ],
    "test_tokens_per_second": [
        ("def tokens_per_second(num_tokens, seconds):\n    return seconds / num_tokens", "tokens_per_second(100, 2.0)"),
        ("def tokens_per_second(num_tokens, seconds):\n    return num_tokens / seconds", "tokens_per_second(10, 0)"),
        ("def tokens_per_second(num_tokens, seconds):\n    if seconds <= 0:\n        raise ValueError('bad duration')\n"
         "    return num_tokens / seconds", "must name the bad value"),
    ],
    "test_tokens_per_second_more": [
        ("def tokens_per_second(num_tokens, seconds):\n    if num_tokens <= 0 or seconds <= 0:\n"
         "        raise ValueError(f'seconds={seconds}')\n    return num_tokens / seconds", "tokens_per_second(0, 1.0)"),
        ("def tokens_per_second(num_tokens, seconds):\n    if seconds == 0:\n        raise ValueError(f'seconds={seconds}')\n"
         "    return num_tokens / seconds", "tokens_per_second(5, -0.5)"),
        ("def tokens_per_second(num_tokens, seconds):\n    if seconds < 0.01:\n        raise ValueError(f'seconds={seconds}')\n"
         "    return num_tokens / seconds", "tokens_per_second(3, 0.001)"),
    ],
    "test_e2e_latency": [
        ("def e2e_latency_s(ttft_s, tpot_s, n):\n    return ttft_s + tpot_s * n", "off by one token"),
        ("def e2e_latency_s(ttft_s, tpot_s, n):\n    return tpot_s * n", "e2e_latency_s(0.5, 0.05, 11)"),
        ("def e2e_latency_s(ttft_s, tpot_s, n):\n    return tpot_s * (n - 1)", "e2e_latency_s(0.5, 0.05, 11)"),
    ],
    "test_e2e_latency_engine": [
        ("def e2e_latency_s(ttft_s, tpot_s, n):\n    return ttft_s + tpot_s * n", "the engine measured"),
        ("def e2e_latency_s(ttft_s, tpot_s, n):\n    return tpot_s * n", "e2e_latency_s(0.3, 0.05, 8)"),
        ("def e2e_latency_s(ttft_s, tpot_s, n):\n    return ttft_s + tpot_s * (n - 1) if n > 8 else ttft_s * n",
         "e2e_latency_s(0.3, 0.05, 8)"),
    ],
    "test_measure_rates": [
        ("decode_tokens_per_s = tokens_per_second(metrics.num_output_tokens, metrics.e2e_s - metrics.ttft_s)",
         "off by one token"),
        ("decode_tokens_per_s = tokens_per_second(metrics.num_output_tokens - 1, metrics.e2e_s)",
         "decode_tokens_per_s = "),
        ("prompt_tokens_per_s = tokens_per_second(metrics.num_prompt_tokens, metrics.e2e_s)",
         "prefill is the time to the first token"),
    ],
    "test_answer_decode_90": [
        ("answer_decode_90_tokens = 90", "answer_decode_90_tokens = 90"),
        ("answer_decode_90_tokens = round(metrics.ttft_s / metrics.tpot_s) + 1", "answer_decode_90_tokens = 7"),
        ("answer_decode_90_tokens = round(0.9 * metrics.ttft_s / metrics.tpot_s)", "not 90 %"),
    ],
}


@pytest.fixture(scope="module")
def lab00_namespace(default_llm):
    """The solution cells of lab 00 run over what its test cells read: the model, a request's output, its metrics."""
    prompt = "The capital of France is"
    outputs = [SimpleNamespace(prompt=prompt, prompt_token_ids=default_llm.tokenizer.encode(prompt))]
    seed = {"lab00": lab00, "llm": default_llm, "outputs": outputs,
            "metrics": FAKE_METRICS, "DEVICE": DEVICE}  # math: the test cells import it themselves
    return run_solution_cells(MASTER, seed)


@pytest.mark.parametrize("grade_id, mistake, case", [(g, m, c) for g, cases in MISTAKES.items() for m, c in cases],
                         ids=[f"{g}-{i}" for g, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_check_fails_on_a_plausible_mistake(lab00_namespace, grade_id, mistake, case):
    assert_check_fails(MASTER, grade_id, lab00_namespace, mistake, case)


def test_answer_decode_90_is_the_first_length_past_90_percent():
    n = lab00.decode_90_tokens(0.3, 0.05)
    share = lambda k: 0.05 * (k - 1) / (0.3 + 0.05 * (k - 1))  # noqa: E731
    assert n == 55 and share(n) >= 0.9 > share(n - 1)
    assert lab00.decode_90_tokens(0.05, 0.05) == 10
