"""Lab 08 (serving and cost): the master has every graded piece, hidden tests and a hand-graded
write-up with its rubric kept out of the generated copies; the solutions pass every check; the checks
name each usual mistake (a [DONE] parsed as JSON, the role-only chunk timed as the first token, the
first token's wait counted as a gap, failed requests counted as good, a fraction instead of a rate,
the hourly price used per second, the largest batch instead of the cheapest, ties and edges); every graded test cell fails on two or three
plausible mistakes (MISTAKES, run by lab_utils.assert_check_fails); the learner's stream timer agrees with
the openai client on the real server; the learner's two speeds per batch are the load generator's own; the
batch sweep through the server and the cost ladder come out right on a short run of the default model."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import nbformat
import pytest

from lab_utils import (
    assert_check_fails,
    nbgrader_cells,
    notebook_functions,
    run_solution_cells,
)

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab08
from minillm.lab.common import CheckFailed, figure_subtitle

LAB = "08_serving_cost"
MASTER = SOURCE_DIR / LAB / f"{LAB}.ipynb"
EXERCISES = {"parse_sse", "stream_metrics", "goodput", "cost_per_million", "choose_batch_size",
             "measure_batch_sweep", "answer_best_lever", "measure_head_of_line"}
AUTOGRADED = {"test_parse_sse": 2, "test_parse_sse_edges": 1, "test_stream_metrics": 2, "test_stream_on_server": 2,
              "test_goodput": 2, "test_cost_per_million": 2, "test_choose_batch_size": 3,
              "test_measure_batch_sweep": 2, "test_answer_best_lever": 1, "test_measure_head_of_line": 2}
WRITEUP_POINTS = 4
HOURLY = 0.08


def _request(ttft: float, tpot: float, tokens: int, start: float) -> dict:
    return {"success": True, "ttft_s": ttft, "tpot_s": tpot, "e2el_s": ttft + tpot * (tokens - 1),
            "output_tokens": tokens, "start_s": start}


def stub_sweep() -> list[dict]:
    """serve_batch_sweep's raw rows, made up (batch 1, 2, 4; TPOTs that differ, so a mean of rates is not 1 / a mean)."""
    rows = []
    for b, tpot, duration in ((1, 0.040, 0.75), (2, 0.055, 1.10), (4, 0.090, 1.90)):
        recs = [_request(0.05 + 0.03 * i, tpot * (1 + 0.1 * (i % 3)), 8, 0.2 * (i // b)) for i in range(2 * b)]
        rows.append({"batch": b, "records": recs, "duration_s": duration, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2})
    return rows


def stub_stack(tokens_per_s=(10.0, 40.0, 64.0, 115.2)) -> list:
    """cost_stack's rows, made up: an H100-like ladder where every lever helps (batching's step is the largest,
    speculation's rung the cheapest)."""
    stages = ["naive", "+ continuous batching + paging", "+ int8 weights", "+ speculative decoding"]
    return [SimpleNamespace(stage=stage, tokens_per_s=tps, usd_per_mtok=lab08.reference_cost_per_million(tps, HOURLY),
                            same_tokens=4, num_requests=4, acceptance_rate=None)
            for stage, tps in zip(stages, tokens_per_s)]


@pytest.fixture(scope="module")
def solution(experiments) -> dict:
    """The master's solution code cells, run in one namespace (the measurement on a made-up sweep, the answer on a
    made-up ladder)."""
    ladder = experiments["cost_ladder"](stub_stack(), lab08.reference_cost_per_million, HOURLY)
    return run_solution_cells(MASTER, {"lab08": lab08, "sweep": stub_sweep(), "HOURLY": HOURLY, "ladder": ladder})



_HOL = """import statistics
import time


def measure_head_of_line(servers, clock=time.perf_counter, warmup=1, repeats=3):   # MISTAKE
    result = {}
    for name, server in servers.items():
        samples = []
        for round_ in range(warmup + repeats):
            server.send_long()
            start = clock()
            server.short()
            elapsed = clock() - start
            server.wait_long()
            if round_ >= warmup:
                samples.append(elapsed)
        result[name] = {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
                        "n": len(samples)}
    result["ratio"] = result["off"]["median"] / result["on"]["median"]
    return result
"""
HOL_KEEPS_WARMUP = _HOL.replace("            if round_ >= warmup:\n                samples.append(elapsed)",
                                "            samples.append(elapsed)").replace('"n": len(samples)', '"n": repeats')
HOL_MEAN = _HOL.replace('"median": statistics.median(samples)', '"median": statistics.fmean(samples)')
HOL_INVERTED = _HOL.replace('result["off"]["median"] / result["on"]["median"]', 'result["on"]["median"] / result["off"]["median"]')
HOL_TIMES_LONG = _HOL.replace("            server.send_long()\n            start = clock()", "            start = clock()\n            server.send_long()")
HOL_PERF_COUNTER = _HOL.replace("start = clock()", "start = time.perf_counter()").replace(
    "elapsed = clock() - start", "elapsed = time.perf_counter() - start")


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The experiments the notebook defines in its own cells (the stream through the server, the cost ladder)."""
    return notebook_functions(MASTER, "run_stream", "cost_ladder")


# --------------------------------------------------------------------- the master
def test_master_has_every_graded_piece_with_hidden_tests():
    nb = nbformat.read(MASTER, as_version=4)
    meta = nbgrader_cells(nb)
    for name in EXERCISES:
        cell, m = meta[name]
        assert cell.cell_type == "code" and m["solution"] and not m["locked"] and "### BEGIN SOLUTION" in cell.source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert set(graded) == set(AUTOGRADED) | {"writeup"}
    for gid, points in AUTOGRADED.items():
        cell = meta[gid][0]
        assert cell.cell_type == "code" and "### BEGIN HIDDEN TESTS" in cell.source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and not graded[gid]["solution"] and graded[gid]["points"] == points, gid
    assert sum(AUTOGRADED.values()) == 19
    # the write-up: a markdown answer the learner edits, graded by hand, with the rubric inside the solution region
    writeup, m = meta["writeup"]
    assert writeup.cell_type == "markdown" and m["solution"] and m["grade"] and not m["locked"]
    assert m["points"] == WRITEUP_POINTS
    lines = writeup.source.splitlines()
    assert lines[0] == "### BEGIN SOLUTION" and lines[-1] == "### END SOLUTION"
    assert lines.index("### BEGIN MARK SCHEME") < lines.index("### END MARK SCHEME")
    intro = nb.cells[0].source
    assert "**Graded (23 points)**" in intro and "19 points checked automatically" in intro
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell is not writeup:
            if "nbgrader" in cell.metadata:
                assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
            else:   # the learner's answers to the questions above it; the model answers reach solutions/ only
                assert cell.source.startswith("**Your answers**") and "### BEGIN MODEL ANSWER" in cell.source, cell.id
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "serve_in_thread(llm)" in "".join(c.source for c in code[:4]), "the server starts among the first cells"
    assert "handle.close()" in code[-1].source, "the last cell closes the server"


def test_student_and_solution_copies():
    student = nbformat.read(REPO_ROOT / "labs" / f"{LAB}.ipynb", as_version=4)
    stubs = {c.metadata["nbgrader"]["grade_id"]: c.source for c in student.cells
             if c.metadata.get("nbgrader", {}).get("solution")}
    assert set(stubs) == EXERCISES | {"writeup"}
    for gid in EXERCISES:
        assert "raise NotImplementedError()" in stubs[gid], gid
    assert stubs["writeup"] == "YOUR ANSWER HERE"
    assert "usd_per_mtok\"], m[\"batch\"]" not in stubs["choose_batch_size"]
    solved = nbformat.read(REPO_ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
    writeup = next(c for c in solved.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "writeup")
    assert "Model answer" in writeup.source
    for nb in (student, solved):
        text = json.dumps(nb)
        assert "Rubric" not in text and "MARK SCHEME" not in text, "the rubric is for the instructor's master only"


# --------------------------------------------------------------------- the solutions pass
def test_solution_passes_every_check(solution):
    lab08.check_parse_sse(solution["parse_sse"])
    lab08.check_parse_sse_edges(solution["parse_sse"])
    lab08.check_stream_metrics(solution["stream_metrics"])
    lab08.check_goodput(solution["goodput"])
    lab08.check_cost_per_million(solution["cost_per_million"])
    lab08.check_choose_batch_size(solution["choose_batch_size"])
    assert [round(solution["cost_per_million"](tps, 2.50), 2) for _, tps in lab08.SOURCE_STACK] == \
        list(lab08.SOURCE_USD_PER_MTOK)
    lab08.check_measure_batch_sweep(solution["sweep"])
    assert solution["answer_best_lever"] == "batching"   # the made-up ladder's largest step (4x)


def test_references_agree_with_the_engine_side_modules():
    from minillm.bench import cost

    for tps, usd in lab08.COST_CASES:
        assert lab08.reference_cost_per_million(tps, usd) == pytest.approx(cost.cost_per_million(tps, usd))
    assert lab08.slo_ms({"ttft_s": 0.5, "tpot_s": 0.05}) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="latency_s"):
        lab08.slo_ms({"latency_s": 1.0})


# --------------------------------------------------------------------- the checks name mistakes
def _sse_no_done(lines):
    return [json.loads(line[5:]) for line in lines if line.startswith("data:")]


def _sse_needs_space(lines):
    out = []
    for line in lines:
        line = line.rstrip("\r")
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            out.append(json.loads(line[6:]))
    return out


def _sse_raw(lines):
    out = []
    for line in lines:
        line = line.rstrip("\r")
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                break
            out.append(data)
    return out


def _sse_skips_nothing(lines):   # parses every non-blank line, comments and fields too
    out = []
    for line in lines:
        if "[DONE]" in line:
            break
        if line.strip():
            out.append(json.loads(line.split(":", 1)[1]))
    return out


@pytest.mark.parametrize("wrong, words", [(_sse_no_done, "ends the stream"), (_sse_needs_space, "space is optional"),
                                          (_sse_raw, "parsed JSON"), (_sse_skips_nothing, "raised")])
def test_parse_sse_check_names_the_mistake(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        lab08.check_parse_sse(wrong)


def _metrics_from(pieces_times, sent_s, ttft_from="text", itl_from_sent=False, absolute=False):
    text = "".join(p for p, _ in pieces_times if p)
    text_times = [t for p, t in pieces_times if p]
    all_times = [t for _, t in pieces_times]
    first = (all_times if ttft_from == "any" else text_times)
    ttft = (first[0] - (0 if absolute else sent_s)) if text_times else None
    times = ([sent_s] if itl_from_sent else []) + (all_times if ttft_from == "any" else text_times)
    return {"text": text, "ttft_s": ttft, "itl_s": [b - a for a, b in zip(times, times[1:])]}


def _pieces(timed_lines):
    out = []
    for t, line in timed_lines:
        for event in lab08.reference_parse_sse([line]):
            out.append((lab08.chunk_text(event), t))
    return out


def _timer_counts_every_chunk(timed_lines, sent_s):
    return _metrics_from(_pieces(timed_lines), sent_s, ttft_from="any")


def _timer_absolute(timed_lines, sent_s):
    return _metrics_from(_pieces(timed_lines), sent_s, absolute=True)


def _timer_gap_from_sent(timed_lines, sent_s):
    return _metrics_from(_pieces(timed_lines), sent_s, itl_from_sent=True)


def _timer_indexes_choices(timed_lines, sent_s):
    pieces = []
    for t, line in timed_lines:
        for event in lab08.reference_parse_sse([line]):
            choice = event["choices"][0]
            pieces.append((choice.get("text") or choice["delta"].get("content") or "", t))
    return _metrics_from(pieces, sent_s)


@pytest.mark.parametrize("wrong, words", [(_timer_counts_every_chunk, "carries only the role"),
                                          (_timer_absolute, "subtract it"),
                                          (_timer_gap_from_sent, "the wait for the first token"),
                                          (_timer_indexes_choices, "choices\": \\[\\]")])
def test_stream_metrics_check_names_the_mistake(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        lab08.check_stream_metrics(wrong)


def _good(records, slo, pred=None, strict=False, count_failed=False):
    def meets(value, limit):
        return value is None or (value < limit if strict else value <= limit)

    pred = pred or all
    return [r for r in records if (count_failed or r["success"])
            and (pred(meets(r[k], v) for k, v in slo.items()) if slo else True)]


@pytest.mark.parametrize("wrong, words", [
    (lambda recs, slo, d: len(_good(recs, slo, count_failed=True)) / d, "failed request"),
    (lambda recs, slo, d: len(_good(recs, slo, pred=any)) / d, "every limit"),
    (lambda recs, slo, d: len(_good(recs, slo)) / len(recs) if recs else 0.0, "not the fraction"),
    (lambda recs, slo, d: float(len(_good(recs, slo))), "divide the good requests by duration_s"),
    (lambda recs, slo, d: len(_good(recs, slo, strict=True)) / d, "<=, not <"),
    (lambda recs, slo, d: sum(r["success"] and all(r[k] <= v for k, v in slo.items()) for r in recs) / d, "None"),
])
def test_goodput_check_names_the_mistake(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        lab08.check_goodput(wrong)


@pytest.mark.parametrize("wrong, words", [
    (lambda tps, usd: usd / tps * 1e6, "divide the hourly price by 3600"),
    (lambda tps, usd: usd / 3600 / tps * 1e3, "not 1e3"),
    (lambda tps, usd: usd / 3600 / tps, "price of one token"),
    (lambda tps, usd: usd / 3600 * tps * 1e6, "do not multiply"),
])
def test_cost_check_names_the_mistake(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        lab08.check_cost_per_million(wrong)


def test_cost_check_wants_a_clear_error_for_a_zero_rate(solution):
    def no_guard(tps, usd):
        return usd / 3600 / tps * 1e6

    with pytest.raises(CheckFailed, match="ZeroDivisionError.*raise ValueError naming the value"):
        lab08.check_cost_per_million(no_guard)

    def infinite(tps, usd):
        return float("inf") if tps <= 0 else solution["cost_per_million"](tps, usd)

    with pytest.raises(CheckFailed, match="returned inf"):
        lab08.check_cost_per_million(infinite)

    def vague(tps, usd):
        if tps <= 0:
            raise ValueError("bad rate")
        return solution["cost_per_million"](tps, usd)

    with pytest.raises(CheckFailed, match="name the bad value"):
        lab08.check_cost_per_million(vague)


def _largest_meeting(rows, floor):
    meeting = [r["batch"] for r in rows if r["per_user_tps"] >= floor]
    return max(meeting) if meeting else None


def _cheapest_ignoring_floor(rows, floor):
    return min(rows, key=lambda r: r["usd_per_mtok"])["batch"] if rows else None


def _strict_floor(rows, floor):
    meeting = [r for r in rows if r["per_user_tps"] > floor]
    return min(meeting, key=lambda r: (r["usd_per_mtok"], r["batch"]))["batch"] if meeting else None


def _tie_to_larger(rows, floor):
    meeting = [r for r in rows if r["per_user_tps"] >= floor]
    return min(meeting, key=lambda r: (r["usd_per_mtok"], -r["batch"]))["batch"] if meeting else None


def _returns_row(rows, floor):
    meeting = [r for r in rows if r["per_user_tps"] >= floor]
    return min(meeting, key=lambda r: (r["usd_per_mtok"], r["batch"])) if meeting else None


@pytest.mark.parametrize("wrong, words", [(_largest_meeting, "largest batch that meets the floor is not always"),
                                          (_cheapest_ignoring_floor, "breaks the promise"),
                                          (_strict_floor, ">=, not >"), (_tie_to_larger, "smaller batch"),
                                          (_returns_row, "not its measurement")])
def test_choose_batch_size_check_names_the_mistake(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        lab08.check_choose_batch_size(wrong)


def test_checks_let_not_implemented_through():
    def todo(*args):
        raise NotImplementedError()

    for check in (lab08.check_parse_sse, lab08.check_stream_metrics, lab08.check_goodput,
                  lab08.check_cost_per_million, lab08.check_choose_batch_size):
        with pytest.raises(NotImplementedError):
            check(todo)


# --------------------------------------------------------------------- the engine behind the server
@pytest.fixture(scope="module")
def server(default_llm):
    from minillm.serve import serve_in_thread

    with serve_in_thread(default_llm) as handle:
        yield handle


def test_stream_on_the_server_matches_the_openai_client(server, solution, experiments, capsys):
    run = experiments["run_stream"](server, solution["stream_metrics"], "Name a colour.", max_tokens=6)
    assert run["mine"]["text"] == run["openai_text"] and run["openai_text"]
    assert run["mine"]["ttft_s"] > 0 and len(run["mine"]["itl_s"]) >= 1
    lab08.check_stream(run)
    lab08.print_stream(run)
    assert "openai text" in capsys.readouterr().out
    fig = lab08.stream_figure(run, "cpu: test device")
    assert "cpu: test device" in figure_subtitle(fig) and len(fig.data[0].x) == len(run["mine"]["itl_s"]) + 1

    wrong = experiments["run_stream"](server, _timer_counts_every_chunk, "Name a colour.", max_tokens=6)
    with pytest.raises(CheckFailed, match="role-only chunk"):
        lab08.check_stream(wrong)


def test_goodput_on_a_real_benchmark(server, solution):
    from minillm.bench.serve import run_benchmark

    slo = {"ttft_s": 30.0, "tpot_s": 5.0}
    bench = run_benchmark(server.base_url, endpoint="/v1/chat/completions", num_prompts=3, max_concurrency=3,
                          max_tokens=3, dataset=lab08.chat_dataset(3), goodput=lab08.slo_ms(slo), progress=False)
    recs = lab08.records(bench)
    assert len(recs) == 3 and all(r["success"] and r["output_tokens"] == 3 for r in recs)
    # the learner's two speeds (measure_batch_sweep) are the load generator's own output throughput and 1 / mean TPOT
    aggregate, per_user = lab08.reference_sweep_speeds({"records": recs, "duration_s": bench.duration_s})
    assert aggregate == pytest.approx(bench.output_throughput)
    assert per_user == pytest.approx(1e3 / bench.metrics["tpot"]["mean_ms"])
    lab08.check_goodput_on(solution["goodput"], bench, slo)
    lab08.check_goodput_on(solution["goodput"], bench, {"ttft_s": 1e-6})   # nothing is that fast
    assert solution["goodput"](recs, {"ttft_s": 1e-6}, bench.duration_s) == 0.0
    with pytest.raises(CheckFailed, match="the load generator counts 3 good requests"):
        lab08.check_goodput_on(lambda r, s, d: 0.0, bench, slo)
    fig = lab08.requests_figure(bench, "cpu: test device")
    assert len(fig.data) == 2 and len(fig.data[0].y) == 3
    values = lab08.scrape_metrics(server.url)
    assert any(name.startswith("minillm_generation_tokens_total") and value >= 9 for name, value in values.items())


def test_batch_sweep_through_the_server_and_the_floor(default_llm, solution, capsys):
    rows = lab08.serve_batch_sweep(default_llm, [1, 2], rounds=1, max_tokens=3, dataset=lab08.chat_dataset(4))
    assert [r["batch"] for r in rows] == [1, 2]
    assert all("aggregate_tps" not in r and "per_user_tps" not in r for r in rows), "the speeds are the learner's"
    lab08.print_sweep_records(rows)
    assert "duration_s" in capsys.readouterr().out
    run_solution_cells(MASTER, {"lab08": lab08, "sweep": rows, "ladder": solution["ladder"]})   # the model measurement
    lab08.check_measure_batch_sweep(rows)
    for r in rows:
        assert len(r["records"]) == r["batch"] and all(x["success"] and x["output_tokens"] == 3 for x in r["records"])
        assert r["aggregate_tps"] > 0 and r["per_user_tps"] > 0
        r["usd_per_mtok"] = solution["cost_per_million"](r["aggregate_tps"], 0.08)
    lab08.print_batch_sweep(rows, "cpu: test device")
    assert "per-user tok/s" in capsys.readouterr().out
    floor = min(r["per_user_tps"] for r in rows)
    chosen = solution["choose_batch_size"](rows, floor)
    assert chosen == min(rows, key=lambda r: (r["usd_per_mtok"], r["batch"]))["batch"]
    fig = lab08.batch_figure(rows, "cpu: test device", floor, chosen)
    assert list(fig.data[3].x) == [chosen] and list(fig.data[2].y) == [floor, floor]
    explorer = lab08.FloorExplorer(rows, solution["choose_batch_size"], "cpu: test device", floor)
    assert explorer.slider.value == pytest.approx(floor, abs=0.05)   # the slider keeps one decimal
    assert explorer.chosen == solution["choose_batch_size"](rows, explorer.slider.value)
    assert list(explorer.figure.data[2].y) == [explorer.slider.value] * 2
    explorer.slider.value = explorer.slider.max   # faster than any measured batch
    assert explorer.chosen is None and "no measured batch" in explorer.label.value
    assert list(explorer.figure.data[3].x) == []
    with pytest.raises(ValueError, match="batch size 0"):
        lab08.serve_batch_sweep(default_llm, [0])


def test_cost_ladder_beside_the_h100(default_llm, solution, experiments, capsys):
    from minillm.bench.cost import cost_stack, cost_workload

    stack = cost_stack(default_llm, requests=cost_workload(default_llm, 2, 3), hourly_usd=0.08, progress=False)
    ladder = experiments["cost_ladder"](stack, solution["cost_per_million"], 0.08)
    assert [r["stage"] for r in ladder] == [row.stage for row in stack]
    assert ladder[0]["gain_vs_naive"] == 1.0 and ladder[0]["h100_usd_per_mtok"] == pytest.approx(20.83, abs=0.005)
    assert ladder[-1]["h100_gain_vs_naive"] == pytest.approx(1335 / (100 / 3))
    for r, row in zip(ladder, stack):
        assert r["usd_per_mtok"] == pytest.approx(row.usd_per_mtok)
    lab08.print_ladder(ladder, "cpu: test device")
    assert "the H100 ladder: 40x" in capsys.readouterr().out
    fig = lab08.ladder_figure(ladder, "cpu: test device")
    assert len(fig.data) == 2 and list(fig.data[1].y) == pytest.approx([r["h100_gain_vs_naive"] for r in ladder])
    with pytest.raises(CheckFailed, match="check exercise 4"):
        experiments["cost_ladder"](stack, lambda tps, usd: usd / tps * 1e6, 0.08)


# --------------------------------------------------------------------- every graded test cell fails on plausible mistakes
_PARSE = """
import json

def parse_sse(lines):
    out = []
    for line in lines:
        {body}
    return out
"""

_TIMER = """
def stream_metrics(timed_lines, sent_s):
    pieces, times = [], []
    for arrival_s, line in timed_lines:
        for event in parse_sse([line]):
            choices = event.get("choices") or []
            if not choices:
                continue
            choice = choices[0]
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {{}}).get("content")
            {keep}
    {ttft}
    {gaps}
    return {{"text": "".join(pieces), "ttft_s": ttft, "itl_s": [b - a for a, b in zip(gaps, gaps[1:])]}}
"""
_KEEP_TEXT = "if piece:\n                pieces.append(piece)\n                times.append(arrival_s)"
_KEEP_EVERY = "pieces.append(piece or '')\n            times.append(arrival_s)"
_TTFT = "ttft = times[0] - sent_s if times else None"
_TIMER_ROLE = _TIMER.format(keep=_KEEP_EVERY, ttft=_TTFT, gaps="gaps = times")          # the role chunk is a token
_TIMER_FROM_SENT = _TIMER.format(keep=_KEEP_TEXT, ttft=_TTFT, gaps="gaps = [sent_s] + times")   # TTFT is a gap
_TIMER_ABSOLUTE = _TIMER.format(keep=_KEEP_TEXT, ttft="ttft = times[0] if times else None", gaps="gaps = times")
_RERUN = '\nstream_run = run_stream(handle, stream_metrics, "Name a colour.", max_tokens=6)\n'

_GOODPUT = """
def goodput(records, slo, duration_s):
    good = [r for r in records if {ok} and {meets}(r[k] is None or r[k] {cmp} v for k, v in slo.items())]
    return len(good) / {per}
"""


def _goodput(ok="r['success']", meets="all", cmp="<=", per="duration_s"):
    return _GOODPUT.format(ok=ok, meets=meets, cmp=cmp, per=per)


_CHOOSE = """
def choose_batch_size(measurements, per_user_floor_tps):
    meeting = [m for m in measurements if {keep}]
    return min(meeting, key=lambda m: {key})["batch"] if meeting else None
"""

_SPEEDS = """
import statistics

for row in sweep:
    ok = [r for r in row["records"] if r["success"]]
    row["per_user_tps"] = {per_user}
    row["aggregate_tps"] = {aggregate}
sweep_speeds = [{{key: row.get(key) for key in ("batch", "aggregate_tps", "per_user_tps")}} for row in sweep]
"""
_PER_USER = '1 / statistics.fmean(r["tpot_s"] for r in ok if r["tpot_s"] is not None)'
_AGGREGATE = 'sum(r["output_tokens"] for r in ok) / row["duration_s"]'

MISTAKES = {
    "test_parse_sse": [
        (_PARSE.format(body='if line.startswith("data:"):\n            out.append(json.loads(line[5:]))'),
         "raised JSONDecodeError"),                                              # [DONE] parsed as JSON
        (_PARSE.format(body='line = line.rstrip("\\r")\n        if line.startswith("data:") and line[5:].strip() != "[DONE]":'
                            '\n            out.append(json.loads(line[5:]))'),
         "ends the stream"),                                                     # skips [DONE], reads on after it
        (_PARSE.format(body='line = line.rstrip("\\r")\n        if line.startswith("data:"):\n            data = line[5:].strip()'
                            '\n            if data == "[DONE]":\n                break\n            out.append(data)'),
         "parsed JSON"),                                                         # the raw text, not json.loads
    ],
    "test_parse_sse_edges": [
        (_PARSE.format(body='line = line.rstrip("\\r")\n        if line.startswith("data: [DONE]"):\n            break'
                            '\n        if line.startswith("data: "):\n            out.append(json.loads(line[6:]))'),
         "space is optional"),                                                   # 'data: ' with the space only
        (_PARSE.format(body='if "[DONE]" in line:\n            break\n        line = line.rstrip("\\r")'
                            '\n        if line.startswith("data:"):\n            out.append(json.loads(line[5:]))'),
         "inside a JSON string is data"),                                        # searches the line for [DONE]
        (_PARSE.format(body='if line.startswith("data:"):\n            data = line[5:].strip(" ")'
                            '\n            if data == "[DONE]":\n                break\n            out.append(json.loads(data))'),
         "strip a trailing"),                                                    # keeps the '\\r'
    ],
    "test_stream_metrics": [
        (_TIMER_ROLE, "carries only the role"),
        (_TIMER_FROM_SENT, "the wait for the first token"),
        (_TIMER_ABSOLUTE, "subtract it"),
    ],
    "test_stream_on_server": [
        (_TIMER_ROLE + _RERUN, "the role-only chunk"),
        (_TIMER_FROM_SENT + _RERUN, "inter-token gaps"),
        (_TIMER_ABSOLUTE + _RERUN, "after the request was sent"),
    ],
    "test_goodput": [
        (_goodput(ok="True"), "failed request"),
        (_goodput(meets="any"), "every limit"),
        (_goodput(per="len(records) if records else 1"), "not the fraction"),
        (_goodput(cmp="<"), "<=, not <"),
    ],
    "test_cost_per_million": [
        ("def cost_per_million(tokens_per_s, hourly_usd):\n    return hourly_usd / tokens_per_s * 1e6\n",
         "divide the hourly price by 3600"),
        ("def cost_per_million(tokens_per_s, hourly_usd):\n    return hourly_usd / 3600 / tokens_per_s * 1e3\n",
         "not 1e3"),
        ("def cost_per_million(tokens_per_s, hourly_usd):\n    return hourly_usd / 3600 / tokens_per_s * 1e6\n",
         "raise ValueError naming the value"),                                   # no guard for a rate of 0
    ],
    "test_choose_batch_size": [
        (_CHOOSE.format(keep='m["per_user_tps"] >= per_user_floor_tps', key='-m["batch"]'),
         "largest batch that meets the floor is not always"),
        (_CHOOSE.format(keep='m["per_user_tps"] > per_user_floor_tps', key='(m["usd_per_mtok"], m["batch"])'),
         ">=, not >"),
        (_CHOOSE.format(keep="True", key='(m["usd_per_mtok"], m["batch"])'), "breaks the promise"),
        (_CHOOSE.format(keep='m["per_user_tps"] >= per_user_floor_tps', key='(m["usd_per_mtok"], -m["batch"])'),
         "smaller batch"),
    ],
    "test_measure_batch_sweep": [
        (_SPEEDS.format(per_user='statistics.fmean(1 / r["tpot_s"] for r in ok if r["tpot_s"] is not None)',
                        aggregate=_AGGREGATE), "not the mean of the 1 / TPOT"),
        (_SPEEDS.format(per_user='statistics.fmean(r["output_tokens"] / r["e2el_s"] for r in ok)',
                        aggregate=_AGGREGATE), "counts the wait for the first token"),
        (_SPEEDS.format(per_user=_PER_USER, aggregate='row["per_user_tps"] * row["batch"]'),
         "assumes every user streamed at full speed"),
        (_SPEEDS.format(per_user=_PER_USER, aggregate='sum(r["output_tokens"] for r in ok) / sum(r["e2el_s"] for r in ok)'),
         "not by the sum of the requests' e2el_s"),
    ],
    "test_measure_head_of_line": [
        (HOL_KEEPS_WARMUP, "drop the first `warmup` calls"),
        (HOL_MEAN, "the mean: one slow outlier"),
        (HOL_INVERTED, "inverted"),
        (HOL_TIMES_LONG, "start the clock after send_long()"),
        (HOL_PERF_COUNTER, "the FakeClock was never read"),
    ],
    "test_answer_best_lever": [
        ('answer_best_lever = "speculation"\n', "is the cheapest rung"),       # the cheapest rung, not the largest step
        ('answer_best_lever = "quantization"\n', "x prev"),
        ('answer_best_lever = "+ continuous batching + paging"\n', "one word"),  # the stage's name, not the word
    ],
}


@pytest.fixture(scope="module")
def graded_namespace(solution, server, experiments) -> dict:
    """What the graded test cells read: the solution cells' names, the server and one stream through it, a short
    benchmark on it, the made-up sweep (measured by the solution) and a ladder of made-up rungs."""
    from minillm.bench.serve import run_benchmark

    slo = {"ttft_s": 2.0, "tpot_s": 0.25}
    bench = run_benchmark(server.base_url, endpoint="/v1/chat/completions", num_prompts=3, max_concurrency=3,
                          max_tokens=3, dataset=lab08.chat_dataset(3), goodput=lab08.slo_ms(slo), progress=False)
    run_stream = experiments["run_stream"]
    return {**solution, "handle": server, "run_stream": run_stream, "SLO": slo, "bench": bench,
            "stream_run": run_stream(server, solution["stream_metrics"], "Name a colour.", max_tokens=6),
            "ladder": experiments["cost_ladder"](stub_stack(), solution["cost_per_million"], HOURLY)}


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(g, m, n) for g, cases in MISTAKES.items() for m, n in cases],
                         ids=[f"{g}-{i}" for g, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    namespace = dict(graded_namespace, sweep=copy.deepcopy(graded_namespace["sweep"]))
    assert_check_fails(MASTER, grade_id, namespace, mistake, names_the_case)


def test_best_lever_check_on_a_cpu_like_ladder(solution, experiments):
    """On a CPU the levers after batching slow things down: the cheapest rung is batching's, and naming a
    lever that made the ladder slower says so."""
    ladder = experiments["cost_ladder"](stub_stack((8.0, 50.0, 33.0, 27.0)), solution["cost_per_million"], HOURLY)
    lab08.check_answer_best_lever(" Batching", ladder)
    with pytest.raises(CheckFailed, match="made tokens/s slower"):
        lab08.check_answer_best_lever("quantization", ladder)
    with pytest.raises(CheckFailed, match="run the cost ladder cell"):
        lab08.check_answer_best_lever("batching", None)
    tie = experiments["cost_ladder"](stub_stack((10.0, 20.0, 40.0, 40.0)), solution["cost_per_million"], HOURLY)
    lab08.check_answer_best_lever("batching", tie)      # 2x and 2x: either is right
    lab08.check_answer_best_lever("quantization", tie)


def test_measure_check_names_missing_speeds():
    with pytest.raises(CheckFailed, match="has no \\['aggregate_tps', 'per_user_tps'\\]"):
        lab08.check_measure_batch_sweep(stub_sweep())
    with pytest.raises(CheckFailed, match="run the sweep cell"):
        lab08.check_measure_batch_sweep(None)


# --------------------------------------------------------------------- head-of-line blocking
def test_measure_head_of_line_solution_and_printouts(solution, capsys):
    lab08.check_measure_head_of_line(solution["measure_head_of_line"])
    lab08.check_measure_head_of_line(solution["measure_head_of_line"], warmup=0, repeats=3, seed=2)
    from minillm.lab.common import FakeClock

    clock = FakeClock()
    fakes = {"off": lab08.FakeHeadOfLine(clock, [9.0, 4.0, 6.0]), "on": lab08.FakeHeadOfLine(clock, [9.0, 1.0, 3.0])}
    got = solution["measure_head_of_line"](fakes, clock=clock, warmup=1, repeats=2)
    assert got["off"]["median"] == pytest.approx(5.0) and got["ratio"] == pytest.approx(2.5)
    lab08.print_head_of_line(got, 400, 64)
    out = capsys.readouterr().out
    assert "2.5x" in out and lab08.REFERENCE_HOL["hardware"] in out
    fig = lab08.head_of_line_figure(got, "cpu: test")
    assert list(fig.data[0].y) == [pytest.approx(5.0), pytest.approx(2.0)]


def test_head_of_line_on_two_real_servers(default_llm, solution):
    """The notebook's two servers (chunked prefill off and on, set explicitly) and the solution's harness on them:
    both give their rows, and the engines' steps show the lever (the whole long prompt in one step when off, no step
    over the chunk when on). Which latency is lower is the learner's measurement, not asserted here."""
    from minillm.serve import serve_in_thread

    servers = notebook_functions(MASTER, "head_of_line_servers", lab08=lab08,
                                 serve_in_thread=serve_in_thread)["head_of_line_servers"](default_llm, 256, 64)
    try:
        got = solution["measure_head_of_line"]({n: h for n, (_, h) in servers.items()}, warmup=1, repeats=1)
    finally:
        for server, _ in servers.values():
            server.close()
    steps = {name: [s.num_tokens for s in hol.engine.engine.stats.steps] for name, (_, hol) in servers.items()}
    assert all(got[name]["n"] == 1 and got[name]["min"] <= got[name]["median"] <= got[name]["max"]
               for name in ("off", "on")), got
    assert got["ratio"] == pytest.approx(got["off"]["median"] / got["on"]["median"])
    assert max(steps["off"]) >= 256 and max(steps["on"]) <= 64, steps
