"""Lab 03 (batching): the example reproduces 19 vs 14 steps, the checks pass the master's solution
and name each usual mistake, the widgets update on slider changes, and the real engine's decode
steps match the simulator."""

from __future__ import annotations

import nbformat
import pytest

from lab_utils import nbgrader_cells, notebook_functions, run_solution_cells

from grading.build import SOURCE_DIR
from minillm.lab import lab03
from minillm.lab.common import CheckFailed

MASTER = SOURCE_DIR / "03_batching" / "03_batching.ipynb"


SOLUTION = run_solution_cells(MASTER, {})
simulate = SOLUTION["simulate_batching"]
num_steps = SOLUTION["num_steps"]
utilisation = SOLUTION["utilisation"]
choose = SOLUTION["largest_batch_meeting_floor"]
LENGTHS = list(lab03.EXAMPLE_OUTPUT_LENGTHS)


def test_master_has_every_graded_piece_with_hidden_tests():
    nb = nbformat.read(MASTER, as_version=4)
    meta = nbgrader_cells(nb)
    for name in ("num_steps", "utilisation", "simulate_batching", "largest_batch_meeting_floor"):
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert set(graded) == {"test_num_steps", "test_utilisation", "test_simulate_static", "test_simulate_continuous",
                           "test_largest_batch_meeting_floor"}
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and graded[gid]["points"] > 0
    assert sum(m["points"] for m in graded.values()) == 8
    for cell in nb.cells:
        if cell.cell_type == "markdown":
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


def test_batch_sweep_rows(default_llm, experiments):
    rows = experiments["measure_batch_sweep"](default_llm, [1, 2], prompt_len=4, max_tokens=3)
    assert [r["batch"] for r in rows] == [1, 2]
    assert [r["output_tokens"] for r in rows] == [3, 6]
    assert all(r["aggregate_tps"] > 0 and r["per_user_tps"] > 0 for r in rows)
    fig = lab03.batch_sweep_figure(rows, "cpu: test")
    assert "cpu: test" in fig.layout.title.subtitle.text and len(fig.data) == 2
