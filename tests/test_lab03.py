"""Lab 03 (batching): the example reproduces 19 vs 14 steps, the checks pass the master's solution
and name each usual mistake (MISTAKES: every graded test cell fails on two or more plausible wrong
answers), the widgets update on slider changes, and the real engine's decode steps match the simulator."""

from __future__ import annotations

import re
from types import SimpleNamespace

import nbformat
import pytest
import torch

from lab_utils import assert_check_fails, nbgrader_cells, notebook_functions, run_solution_cells

from grading.build import SOURCE_DIR
from minillm.lab import lab03
from minillm.lab.common import CheckFailed

MASTER = SOURCE_DIR / "03_batching" / "03_batching.ipynb"


LENGTHS = list(lab03.EXAMPLE_OUTPUT_LENGTHS)
SEED = {"lab03": lab03, "OUTPUT_LENGTHS": LENGTHS, "NUM_SLOTS": lab03.EXAMPLE_NUM_SLOTS,  # what cell 2 defines
        "statistics": __import__("statistics"), "time": __import__("time")}
SOLUTION = run_solution_cells(MASTER, dict(SEED))
simulate = SOLUTION["simulate_batching"]
num_steps = SOLUTION["num_steps"]
utilisation = SOLUTION["utilisation"]
choose = SOLUTION["largest_batch_meeting_floor"]
aggregate_tps = SOLUTION["aggregate_tps"]
per_user_tps = SOLUTION["per_user_tps"]
batching_speedup = SOLUTION["batching_speedup"]


def test_master_has_every_graded_piece_with_hidden_tests():
    nb = nbformat.read(MASTER, as_version=4)
    meta = nbgrader_cells(nb)
    for name in ("num_steps", "utilisation", "simulate_batching", "answer_most_saving_slots", "sweep_speeds",
                 "measure_batching_speedup", "largest_batch_meeting_floor"):
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert set(graded) == {"test_num_steps", "test_utilisation", "test_simulate_static", "test_simulate_continuous",
                           "test_answer_most_saving_slots", "test_sweep_speeds", "test_measure_batching_speedup",
                           "test_largest_batch_meeting_floor"}
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and graded[gid]["points"] > 0
        assert meta[gid][0].source.startswith("lab03.check_"), f"{gid} does not call its check first"
    assert sum(m["points"] for m in graded.values()) == 13
    assert "**Graded (13 points)**" in nb.cells[0].source
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "### BEGIN MODEL ANSWER" not in cell.source:
            assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source
    assert "| steps | 3 | 3 | 4 | 7 | 2 | 6 | 3 | 4 | 3 | 6 | 1 | 5 |" in nb.cells[3].source  # lengths stated


# --------------------------------------------------------------------- the course's example
def test_example_gives_19_vs_14_steps_and_62_vs_84_percent():
    static, continuous = simulate(LENGTHS, 4, "static"), simulate(LENGTHS, 4, "continuous")
    assert (num_steps(static), num_steps(continuous)) == (19, 14)
    assert round(utilisation(static) * 100) == 62 and round(utilisation(continuous) * 100) == 84
    assert len(LENGTHS) == 12 and sum(LENGTHS) == 47
    assert simulate(LENGTHS, 4, "static") == lab03.reference_schedule(LENGTHS, 4, "static")
    assert simulate(LENGTHS, 4, "continuous") == lab03.reference_schedule(LENGTHS, 4, "continuous")


def test_solution_passes_every_check(passes):
    assert passes(lab03.check_num_steps, num_steps).startswith("✓")
    assert passes(lab03.check_utilisation, utilisation).startswith("✓")
    assert passes(lab03.check_simulate_batching, simulate).startswith("✓")
    assert passes(lab03.check_largest_batch_meeting_floor, choose).startswith("✓")
    assert passes(lab03.check_sweep_speeds, aggregate_tps, per_user_tps, RAW_SWEEP).startswith("✓")
    assert passes(lab03.check_answer_most_saving_slots, SOLUTION["answer_most_saving_slots"]).startswith("✓")


def test_most_saving_slots_is_a_difference_of_steps_not_a_ratio():
    best, steps = lab03.most_saving_slots(LENGTHS)
    assert best == 2 and steps[2] == (31, 24) and steps[4] == (19, 14)
    assert max(steps, key=lambda n: steps[n][0] / steps[n][1]) == 11  # the ratio's answer is another one
    assert SOLUTION["answer_most_saving_slots"] == 2


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 12, 20])
def test_simulator_bounds(slots):
    static, continuous = simulate(LENGTHS, slots, "static"), simulate(LENGTHS, slots, "continuous")
    assert max(LENGTHS) <= num_steps(continuous) <= num_steps(static) <= sum(LENGTHS)
    if slots == 1:
        assert num_steps(static) == num_steps(continuous) == sum(LENGTHS)


# --------------------------------------------------------------------- the checks teach
def _static_that_refills(lengths, num_slots, policy):
    return simulate(lengths, num_slots, "continuous")


def _continuous_that_waits(lengths, num_slots, policy):
    return simulate(lengths, num_slots, "static")


def _one_step_short(lengths, num_slots, policy):
    return simulate([max(n - 1, 1) if i == 0 else n for i, n in enumerate(lengths)], num_slots, policy)


def _refill_one_step_late(lengths, num_slots, policy):
    """A freed slot sits idle for one step before it takes the next request."""
    waiting, slots, left, cooldown = list(range(len(lengths))), [None] * num_slots, [0] * num_slots, [0] * num_slots
    out = []
    while waiting or any(r is not None for r in slots):
        for s in range(num_slots):
            if slots[s] is None and waiting and cooldown[s] == 0:
                slots[s] = waiting.pop(0)
                left[s] = lengths[slots[s]]
        out.append(list(slots))
        for s in range(num_slots):
            cooldown[s] = max(cooldown[s] - 1, 0)
            if slots[s] is not None:
                left[s] -= 1
                if left[s] == 0:
                    slots[s], cooldown[s] = None, 1
    return out


def _percent(schedule):
    return 100 * utilisation(schedule)


def _counts_trailing(schedule):
    return len(schedule)


@pytest.mark.parametrize("bad, policy, expected", [
    (_static_that_refills, "static", "static policy admitted request 4 at step 3 while request 2 of the same batch was "
                                     "still running"),
    (_continuous_that_waits, "continuous", "continuous policy left slot 0 idle at step 3 while request 4 was waiting"),
    (_one_step_short, "static", "request 0 decodes in 2 slot-steps, but it needs output_lengths[0] = 3 steps"),
    (_refill_one_step_late, "continuous", "continuous policy left slot 0 idle at step 3 while request 4 was waiting"),
])
def test_simulate_check_names_the_mistake(bad, policy, expected):
    with pytest.raises(CheckFailed) as failure:
        lab03.check_simulate_batching(bad, policies=[policy])
    assert expected in str(failure.value)
    assert "step  0:" in str(failure.value) or "output_lengths" in str(failure.value)


def test_static_that_leaves_slots_empty_is_named():
    def half_full(lengths, num_slots, policy):  # one slot never used
        return [step + [None] for step in simulate(lengths, num_slots - 1, policy)]

    with pytest.raises(CheckFailed, match="static policy started only 3 request"):
        lab03.check_simulate_batching(half_full, policies=["static"])


def test_wrong_shapes_are_named():
    with pytest.raises(CheckFailed, match="every step must list exactly 4 slots"):
        lab03.check_simulate_batching(lambda l, n, p: [[0]] * 3, policies=["static"])
    with pytest.raises(CheckFailed, match="expected a list of steps"):
        lab03.check_simulate_batching(lambda l, n, p: 19, policies=["static"])


def test_num_steps_and_utilisation_checks_teach():
    with pytest.raises(CheckFailed, match="you counted the trailing all-idle steps"):
        lab03.check_num_steps(_counts_trailing)
    with pytest.raises(CheckFailed, match="return a fraction in \\[0, 1\\], not a percentage"):
        lab03.check_utilisation(_percent)
    with pytest.raises(CheckFailed, match="the trailing idle steps count in neither"):
        lab03.check_utilisation(lambda s: sum(r is not None for st in s for r in st) / (len(s) * len(s[0])))


def test_floor_check_teaches_greater_equal():
    with pytest.raises(CheckFailed, match="use >="):
        lab03.check_largest_batch_meeting_floor(
            lambda b, t, f: max([x for x, v in zip(b, t) if v > f], default=None))


# --------------------------------------------------------------------- widgets
def test_schedule_explorer_redraws_on_slider_and_dropdown():
    explorer = lab03.ScheduleExplorer(simulate, LENGTHS, 4, "continuous")
    assert "14 steps" in explorer.label.value and "84%" in explorer.label.value
    explorer.dropdown.value = "static"
    assert "19 steps" in explorer.label.value and "62%" in explorer.label.value
    explorer.slider.value = 1
    assert "47 steps" in explorer.label.value
    assert len(explorer.figure.data[0].z) == 1 and len(explorer.figure.data[0].z[0]) == 47
    explorer.slider.value = 12
    assert "7 steps" in explorer.label.value and len(explorer.figure.data[0].y) == 12


def test_schedule_explorer_waits_for_the_exercise():
    def stub(*args):
        raise NotImplementedError()

    explorer = lab03.ScheduleExplorer(stub)
    assert "finish exercise 2" in explorer.label.value


def test_gantt_figure_has_one_panel_per_policy():
    fig = lab03.gantt_figure({p: simulate(LENGTHS, 4, p) for p in lab03.POLICIES}, LENGTHS)
    assert len(fig.data) == 2
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["static: 19 steps, utilisation 62%", "continuous: 14 steps, utilisation 84%"]


ROWS = [{"batch": b, "per_user_tps": u, "aggregate_tps": a, "tpot_s": 1 / u}
        for b, u, a in [(1, 20.0, 20.0), (2, 18.0, 36.0), (4, 15.0, 60.0), (8, 9.0, 72.0)]]


def test_floor_explorer_moves_the_choice():
    view = lab03.FloorExplorer(ROWS, choose, "cpu: test", floor=10.0)
    assert view.chosen == 4 and "batch 4" in view.label.value and "60.0 tok/s" in view.label.value
    assert list(view.figure.data[3].x) == [4]
    view.slider.value = 5.0
    assert view.chosen == 8
    view.slider.value = 21.0
    assert view.chosen is None and "no measured batch" in view.label.value
    assert list(view.figure.data[2].y) == [21.0, 21.0]
    assert "cpu: test" in view.figure.layout.title.subtitle.text


# --------------------------------------------------------------------- the roofline of batched decode
# 1e8 fp32 parameters (4e8 bytes) read at 20 GB/s: 50 tok/s per sequence in a step; 100 GFLOP/s over 2e8 FLOPs per
# token: 500 tok/s whatever the batch. They meet at b* = 1e11 * 4e8 / (2 * 1e8 * 2e10) = 10.
ROOF = lab03.DecodeRoofline(num_params=1e8, weight_bytes=4e8, bandwidth_bytes_per_s=20e9, flops_per_s=100e9)


def test_roofline_of_batched_decode_by_hand():
    assert ROOF.bytes_per_param == 4.0
    assert [ROOF.bandwidth_tps(b) for b in (1, 2, 8, 32)] == pytest.approx([50.0, 100.0, 400.0, 1600.0])
    assert ROOF.compute_tps() == ROOF.compute_tps(32) == pytest.approx(500.0)
    assert [ROOF.roofline_tps(b) for b in (1, 8, 10, 16, 32)] == pytest.approx([50.0, 400.0, 500.0, 500.0, 500.0])
    assert ROOF.crossover_batch == pytest.approx(10.0)
    assert ROOF.first_compute_bound_batch == 10  # at b* exactly the two bounds tie: compute, as lab 01's ridge
    assert [ROOF.bound(b) for b in (1, 9, 10, 11)] == ["bandwidth", "bandwidth", "compute", "compute"]
    # b* is FLOP/s x bytes / (2 x params x bandwidth): halving the bytes per weight (bf16) halves it
    bf16 = lab03.DecodeRoofline(1e8, 2e8, 20e9, 100e9)
    assert bf16.crossover_batch == pytest.approx(5.0) and bf16.first_compute_bound_batch == 5
    # an H200-like device with this model in bf16: 4e12 B/s, 6e14 FLOP/s -> b* = 6e14 * 2.7e8 / (2 * 1.35e8 * 4e12)
    gpu = lab03.DecodeRoofline(1.35e8, 2.7e8, 4e12, 6e14)
    assert gpu.crossover_batch == pytest.approx(150.0) and gpu.first_compute_bound_batch == 150
    assert gpu.bandwidth_tps(1) == pytest.approx(4e12 / 2.7e8)
    # a b* between whole batches rounds up: 7.5 -> 8
    assert lab03.DecodeRoofline(1e8, 4e8, 20e9, 75e9).first_compute_bound_batch == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_params=0), "num_params=0 must be a finite number > 0"),
    (dict(weight_bytes=-4e8), "weight_bytes=-400000000.0 must be a finite number > 0"),
    (dict(bandwidth_bytes_per_s=float("inf")), "bandwidth_bytes_per_s=inf must be a finite number > 0"),
    (dict(flops_per_s="1e11"), "flops_per_s='1e11' must be a finite number > 0"),
])
def test_roofline_refuses_bad_numbers(kwargs, message):
    args = dict(num_params=1e8, weight_bytes=4e8, bandwidth_bytes_per_s=20e9, flops_per_s=100e9) | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        lab03.DecodeRoofline(**args)


@pytest.mark.parametrize("batch", [0, 0.5, -1, True, float("nan")])
def test_roofline_refuses_a_batch_below_one(batch):
    with pytest.raises(ValueError, match=re.escape(f"batch={batch!r} must be a finite number >= 1")):
        ROOF.roofline_tps(batch)


def test_batch_sweep_printout_shows_each_batch_against_the_roofline(capsys):
    lab03.print_batch_sweep(ROWS, "cpu: test", ROOF)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "measured on cpu: test" and "of roofline" in lines[1] and "bound" in lines[1]
    # aggregate 20, 36, 60, 72 against ceilings 50, 100, 200, 400: 40%, 36%, 30%, 18%, all bandwidth-bound
    rows = [line.split() for line in lines[2:6]]
    assert [r[0] for r in rows] == ["1", "2", "4", "8"]
    assert [r[-3:] for r in rows] == [["50.0", "40%", "bandwidth"], ["100.0", "36%", "bandwidth"],
                                      ["200.0", "30%", "bandwidth"], ["400.0", "18%", "bandwidth"]]
    assert "b* = 10.0" in lines[6] and "compute-bound from batch 10" in lines[6] and "20 GB/s" in lines[6]
    wide = [dict(ROWS[0], batch=16, aggregate_tps=250.0)]
    lab03.print_batch_sweep(wide, "cpu: test", ROOF)
    assert capsys.readouterr().out.splitlines()[2].split()[-3:] == ["500.0", "50%", "compute"]
    lab03.print_batch_sweep(ROWS, "cpu: test")  # without a roofline: the speeds alone
    assert "roofline" not in capsys.readouterr().out


def test_batch_sweep_figure_draws_both_bounds_dashed_and_their_corner():
    fig = lab03.batch_sweep_figure(ROWS, "cpu: test", ROOF)
    assert len(fig.data) == 5 and fig.layout.yaxis.type == "log" and fig.layout.xaxis.type == "log"
    bandwidth, compute, corner = fig.data[2], fig.data[3], fig.data[4]
    assert bandwidth.line.dash == compute.line.dash == "dash"
    assert list(bandwidth.x) == [1, 2, 4, 8, 10, 20]  # the sizes measured, b*, and past it to show the corner
    assert list(bandwidth.y) == pytest.approx([50, 100, 200, 400, 500, 1000])
    assert list(compute.y) == pytest.approx([500] * 6)
    assert list(corner.x) == pytest.approx([10.0]) and list(corner.y) == pytest.approx([500.0])
    assert corner.text == ("b* = 10.0",)
    assert "cpu: test" in fig.layout.title.subtitle.text
    # b* far past the sweep: the bounds stop at 16 x the largest batch, with no corner drawn
    far = lab03.batch_sweep_figure(ROWS, "cuda: test", lab03.DecodeRoofline(1.35e8, 2.7e8, 4e12, 6e14))
    assert len(far.data) == 4 and max(far.data[2].x) == 128


def test_measure_decode_roofline_uses_the_engines_numbers(monkeypatch):
    """The learner's engine gives the parameters, weight bytes, device and dtype; quick mode measures small."""
    from minillm import hardware

    calls = []
    monkeypatch.setattr(hardware, "measure_memory_bandwidth",
                        lambda device, **kw: calls.append(("bandwidth", device, kw)) or 20e9)
    monkeypatch.setattr(hardware, "measure_matmul_flops",
                        lambda device, **kw: calls.append(("flops", device, kw)) or 100e9)
    llm = SimpleNamespace(engine=SimpleNamespace(device=torch.device("cpu")), dtype=torch.float32, weight_bytes=4e8,
                          model_config=SimpleNamespace(num_params=1e8))
    roof = lab03.measure_decode_roofline(llm, quick=True)
    assert (roof.num_params, roof.weight_bytes, roof.bandwidth_bytes_per_s, roof.flops_per_s) == (1e8, 4e8, 20e9, 100e9)
    assert roof.crossover_batch == pytest.approx(10.0)
    assert calls == [("bandwidth", "cpu", {"nbytes": lab03.QUICK_BANDWIDTH_BYTES, "repeats": 3}),
                     ("flops", "cpu", {"size": lab03.QUICK_MATMUL_SIZE, "dtype": torch.float32, "repeats": 3})]
    calls.clear()
    llm.engine.device, llm.dtype = torch.device("cuda", 0), torch.bfloat16
    lab03.measure_decode_roofline(llm)
    assert calls == [("bandwidth", "cuda:0", {}),
                     ("flops", "cuda:0", {"size": lab03.GPU_MATMUL_SIZE, "dtype": torch.bfloat16})]


def test_master_measures_the_roofline_before_the_sweep_and_shows_it_after():
    nb = nbformat.read(MASTER, as_version=4)
    ids = [cell.get("id") for cell in nb.cells]
    source = {cell.get("id"): cell.source for cell in nb.cells}
    order = [ids.index(cid) for cid in ("roofline-md", "predict-crossover", "measure-roofline", "cell-19")]
    assert order == sorted(order), order
    assert "**Predict:**" in source["roofline-md"] and "predicted_crossover_batch = None" in source["predict-crossover"]
    assert "lab03.measure_decode_roofline(llm, quick=QUICK)" in source["measure-roofline"]
    shown = source["sweep-speeds"]
    assert "print_batch_sweep(sweep, DEVICE, roofline)" in shown
    assert "batch_sweep_figure(sweep, DEVICE, roofline)" in shown
    assert "predicted_crossover_batch" in shown and "roofline.crossover_batch" in shown


# --------------------------------------------------------------------- the real engine
@pytest.fixture(scope="module")
def experiments() -> dict:
    """The engine runs the master notebook defines, as the learner reads them."""
    return notebook_functions(MASTER, "random_prompts", "measure_batch_sweep", "measure_policies")


def test_engine_decode_steps_match_the_simulator(default_llm, experiments):
    results = experiments["measure_policies"](default_llm, [2, 1, 3, 1, 1], num_slots=2, prompt_len=4)
    assert results["static"]["decode_steps"] == num_steps(simulate([2, 1, 3, 1, 1], 2, "static")) == 6
    assert results["continuous"]["decode_steps"] == num_steps(simulate([2, 1, 3, 1, 1], 2, "continuous")) == 4
    assert results["static"]["output_tokens"] == results["continuous"]["output_tokens"] == 8 + 5


def test_batch_sweep_rows(default_llm, experiments, passes):
    rows = experiments["measure_batch_sweep"](default_llm, [1, 2], prompt_len=4, max_tokens=3)
    assert [r["batch"] for r in rows] == [1, 2]
    assert [r["output_tokens"] for r in rows] == [3, 6]
    assert [set(r) for r in rows] == [{"batch", "output_tokens", "wall_s", "tpots_s"}] * 2  # raw numbers only
    assert [len(r["tpots_s"]) for r in rows] == [1, 2] and all(r["wall_s"] > 0 for r in rows)
    assert passes(lab03.check_sweep_speeds, aggregate_tps, per_user_tps, rows).startswith("✓")
    for r in rows:
        r["aggregate_tps"], r["per_user_tps"] = aggregate_tps(r), per_user_tps(r)
    assert all(r["aggregate_tps"] > 0 and r["per_user_tps"] > 0 for r in rows)
    fig = lab03.batch_sweep_figure(rows, "cpu: test")
    assert "cpu: test" in fig.layout.title.subtitle.text and len(fig.data) == 2


# --------------------------------------------------------------------- every graded check fails on plausible mistakes
# A raw sweep as measure_batch_sweep returns it (no engine): what test_sweep_speeds reads.
RAW_SWEEP = [
    {"batch": 1, "output_tokens": 8, "wall_s": 0.40, "tpots_s": [0.045]},
    {"batch": 2, "output_tokens": 16, "wall_s": 0.44, "tpots_s": [0.047, 0.049]},
    {"batch": 4, "output_tokens": 32, "wall_s": 0.52, "tpots_s": [0.052, 0.055, 0.053, 0.058]},
    {"batch": 8, "output_tokens": 64, "wall_s": 0.71, "tpots_s": [0.07, 0.072, 0.069, 0.075, 0.071, 0.07, 0.08, 0.074]},
]


def _solution_source(grade_id: str) -> str:
    return nbgrader_cells(nbformat.read(MASTER, as_version=4))[grade_id][0].source


def _simulate_with(old: str, new: str) -> str:
    """The master's simulate_batching with one plausible slip: old replaced by new."""
    source = _solution_source("simulate_batching")
    assert source.count(old) == 1, old
    return source.replace(old, new)


_CHECK_THEN_DECREMENT = _simulate_with(  # frees a slot one step late: the count is checked before it is decremented
    """                steps_left[s] -= 1
                if steps_left[s] == 0:
                    slots[s] = None""",
    """                if steps_left[s] == 0:
                    slots[s] = None
                steps_left[s] -= 1""")
_LAST_COME_FIRST = _simulate_with("slots[s] = waiting.pop(0)", "slots[s] = waiting.pop()")  # pop() takes the last

_SPEEDUP = """
import statistics, time
def batching_speedup(run_one_at_a_time, run_batched, clock=time.perf_counter, warmup=1, repeats=3):
    def time_runs(run):
        samples = []
        for i in range(warmup + repeats):
            start = {read}
            tokens = run()
            elapsed = {read} - start
            if {keep}:
                samples.append(elapsed)
        median = {stat}(samples)
        return {{"median": median, "min": min(samples), "max": max(samples), "tokens_per_s": {tps}}}
    one, batched = time_runs(run_one_at_a_time), time_runs(run_batched)
    return {{"one at a time": one, "batched": batched, "ratio": {ratio}}}
"""


def _speedup(read="clock()", keep="i >= warmup", stat="statistics.median", tps="tokens / median",
             ratio='batched["tokens_per_s"] / one["tokens_per_s"]'):
    return _SPEEDUP.format(read=read, keep=keep, stat=stat, tps=tps, ratio=ratio)


MISTAKES = {
    "test_num_steps": [
        ("def num_steps(schedule):\n    return len(schedule)\n", "you counted the trailing all-idle steps"),
        ("def num_steps(schedule):\n    return sum(any(r is not None for r in step) for step in schedule)\n",
         "you counted the busy steps"),
        ("def num_steps(schedule):\n    busy = [t for t, step in enumerate(schedule) if any(r is not None for r in step)]\n"
         "    return busy[-1] + 1\n", "num_steps([[None, None], [None, None]]) raised IndexError"),
        ("def num_steps(schedule):\n    busy = [t for t, step in enumerate(schedule) if any(r is not None for r in step)]\n"
         "    return busy[-1] if busy else 0\n", "one short"),
    ],
    "test_utilisation": [
        ("def utilisation(schedule):\n    steps = num_steps(schedule)\n    if steps == 0:\n        return 0.0\n"
         "    busy = sum(r is not None for step in schedule[:steps] for r in step)\n"
         "    return 100 * busy / (steps * len(schedule[0]))\n", "not a percentage"),
        ("def utilisation(schedule):\n    if not schedule:\n        return 0.0\n"
         "    busy = sum(r is not None for step in schedule for r in step)\n"
         "    return busy / (len(schedule) * len(schedule[0]))\n", "the trailing idle steps count in neither"),
        ("def utilisation(schedule):\n    steps = num_steps(schedule)\n"
         "    busy = sum(r is not None for step in schedule[:steps] for r in step)\n"
         "    return busy / (steps * len(schedule[0]))\n",
         "utilisation([[None, None], [None, None]]) raised ZeroDivisionError"),
    ],
    "test_simulate_static": [
        (_simulate_with("all(r is None for r in slots)", "any(r is None for r in slots)"),
         "static policy admitted request 4 at step 3 while request 2 of the same batch was still running"),
        (_CHECK_THEN_DECREMENT, "request 0 decodes in 4 slot-steps, but it needs output_lengths[0] = 3 steps"),
        (_LAST_COME_FIRST, "requests are admitted first come, first served"),
    ],
    "test_simulate_continuous": [
        (_simulate_with('if policy == "continuous" or all(r is None for r in slots):', "if all(r is None for r in slots):"),
         "continuous policy left slot 0 idle at step 3 while request 4 was waiting"),
        (_CHECK_THEN_DECREMENT, "request 0 decodes in 4 slot-steps, but it needs output_lengths[0] = 3 steps"),
        (_LAST_COME_FIRST, "requests are admitted first come, first served"),
    ],
    "test_answer_most_saving_slots": [
        ("answer_most_saving_slots = NUM_SLOTS\n", "answer_most_saving_slots = 4: with 4 slots static takes 19 steps"),
        ("answer_most_saving_slots = len(OUTPUT_LENGTHS)\n", "with a slot per request both policies take"),
        ("ratio = {n: num_steps(simulate_batching(OUTPUT_LENGTHS, n, 'static'))\n"
         "         / num_steps(simulate_batching(OUTPUT_LENGTHS, n, 'continuous')) for n in range(1, 13)}\n"
         "answer_most_saving_slots = max(ratio, key=ratio.get)\n", "the ratio static / continuous is largest"),
    ],
    "test_measure_batching_speedup": [
        (_speedup(keep="True"), "warm-up included"),
        (_speedup(stat="statistics.fmean"), "the mean"),
        (_speedup(stat="min"), "the minimum"),
        (_speedup(ratio='one["tokens_per_s"] / batched["tokens_per_s"]'), "upside down"),
        (_speedup(read="time.perf_counter()"), "never read `clock`"),
        (_speedup(tps="tokens / statistics.fmean(samples)"), "tokens_per_s"),
    ],
    "test_sweep_speeds": [
        ("def per_user_tps(row):\n    return aggregate_tps(row) / row['batch']\n",
         "aggregate / batch spreads the prefill"),
        ("def per_user_tps(row):\n    tpots = row['tpots_s']\n    if not tpots:\n        return None\n"
         "    return sum(1 / t for t in tpots) / len(tpots)\n", "the mean of the requests' speeds"),
        ("def per_user_tps(row):\n    tpots = row['tpots_s']\n    if not tpots:\n        return None\n"
         "    return sum(tpots) / len(tpots)\n", "the mean TPOT itself, in seconds per token: invert it"),
        ("def per_user_tps(row):\n    return len(row['tpots_s']) / sum(row['tpots_s'])\n", "raised ZeroDivisionError"),
        ("def aggregate_tps(row):\n    return row['output_tokens'] / row['wall_s'] / row['batch']\n",
         "don't divide by the batch"),
    ],
    "test_largest_batch_meeting_floor": [
        ("def largest_batch_meeting_floor(batch_sizes, per_user_tps, floor):\n"
         "    meeting = [b for b, tps in zip(batch_sizes, per_user_tps) if tps > floor]\n"
         "    return max(meeting) if meeting else None\n", "use >="),
        ("def largest_batch_meeting_floor(batch_sizes, per_user_tps, floor):\n"
         "    meeting = [b for b, tps in zip(batch_sizes, per_user_tps) if tps >= floor]\n"
         "    return meeting[-1] if meeting else None\n", "the last size in the list that meets it"),
        ("def largest_batch_meeting_floor(batch_sizes, per_user_tps, floor):\n"
         "    return max(b for b, tps in zip(batch_sizes, per_user_tps) if tps >= floor)\n",
         "largest_batch_meeting_floor([1, 2, 4, 8], [50.0, 45.0, 30.0, 12.0], floor=60.0) raised ValueError"),
        ("def largest_batch_meeting_floor(batch_sizes, per_user_tps, floor):\n    best = None\n"
         "    for b, tps in zip(batch_sizes, per_user_tps):\n        if tps < floor:\n            break\n"
         "        best = b\n    return best\n", "sizes in any order"),
    ],
}


@pytest.fixture(scope="module")
def graded_namespace() -> dict:
    """The master's solution cells run as the notebook runs them, plus the state its test cells read."""
    return run_solution_cells(MASTER, dict(SEED, sweep=[dict(r, tpots_s=list(r["tpots_s"])) for r in RAW_SWEEP]))


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(g, m, n) for g, cases in MISTAKES.items() for m, n in cases],
                         ids=[f"{g}-{i}" for g, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_check_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)


# --------------------------------------------------------------------- exercise 4: the timing harness
def test_batching_check_passes_the_solution_and_serve_run_runs_the_engine(default_llm, passes):
    assert passes(lab03.check_batching_speedup, batching_speedup).startswith("✓ batching_speedup: all 3")
    prompts = [{"prompt_token_ids": [100 + i, 200 + i, 300 + i]} for i in range(3)]
    one, batched = lab03.ServeRun(default_llm, prompts, 3, 1), lab03.ServeRun(default_llm, prompts, 3, 3)
    result = batching_speedup(one, batched, warmup=1, repeats=2)
    assert one.calls == batched.calls == 3
    for label in ("one at a time", "batched"):
        r = result[label]
        assert r["min"] <= r["median"] <= r["max"] and r["tokens_per_s"] == pytest.approx(9 / r["median"])
    assert result["ratio"] == pytest.approx(result["batched"]["tokens_per_s"] / result["one at a time"]["tokens_per_s"])
    assert one.engine.stats.steps and max(s.num_seqs for s in one.engine.stats.steps) == 1
    assert max(s.num_seqs for s in batched.engine.stats.steps) == 3
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        lab03.ServeRun(default_llm, prompts, 3, 0)


def test_batching_printout_and_figure(capsys):
    result = {"one at a time": {"median": 2.0, "min": 1.8, "max": 2.5, "tokens_per_s": 16.0},
              "batched": {"median": 0.5, "min": 0.4, "max": 0.8, "tokens_per_s": 64.0}, "ratio": 4.0}
    lab03.print_batching(result, 4)
    out = capsys.readouterr().out
    assert "4 requests, batched / one at a time: yours 4x" in out and lab03.REFERENCE_HARDWARE in out
    fig = lab03.batching_figure(result, 4, "cpu: test")
    assert list(fig.data[0].y) == [16.0, 64.0]
    assert list(fig.data[0].error_y.array) == pytest.approx([32 / 1.8 - 16, 32 / 0.4 - 64])
