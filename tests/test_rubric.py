"""The lab rubric of grading/README.md on every master: predictions kept and echoed, a measurement the learner
writes, a checked short answer, model answers only in solutions/, a points table and the quick-mode note in the
header, and two or more wrong-answer tests for every graded check."""

from __future__ import annotations

import importlib
from pathlib import Path

import nbformat
import pytest

from grading import build, report
from lab_utils import graded_test_ids

LABS = build.discover_labs()
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("lab", LABS)
def test_lab_follows_the_rubric(lab):
    rep = report.report_lab(lab)
    assert not rep.problems, "\n".join(rep.problems)


@pytest.mark.parametrize("lab", LABS)
def test_every_graded_check_has_wrong_answer_tests(lab):
    """tests/test_labNN.py lists two or more plausible mistakes for every graded test cell of the lab."""
    module = importlib.import_module(f"test_lab{lab[:2]}")
    mistakes = getattr(module, "MISTAKES", {})
    master = build.SOURCE_DIR / lab / f"{lab}.ipynb"
    missing = [grade_id for grade_id in graded_test_ids(master) if len(mistakes.get(grade_id, ())) < 2]
    assert not missing, f"tests/test_lab{lab[:2]}.py has fewer than two mistakes for {missing}"
    unknown = sorted(set(mistakes) - set(graded_test_ids(master)))
    assert not unknown, f"MISTAKES names cells the master does not grade: {unknown}"


@pytest.mark.parametrize("lab", LABS)
def test_model_answers_reach_solutions_only(lab):
    master = build.read_master(lab)
    solved = nbformat.read(REPO / "solutions" / f"{lab}.ipynb", as_version=4)
    student = nbformat.read(REPO / "labs" / f"{lab}.ipynb", as_version=4)
    answers = ["\n".join(cell.source.split("\n")[first + 1:last])
               for cell in master.cells for first, last in build.model_answer_regions(cell.source)]
    assert answers, f"{lab} has no model answers"
    solved_text = "\n".join(c.source for c in solved.cells)
    student_text = "\n".join(c.source for c in student.cells)
    for marker in build.MODEL_ANSWER_MARKERS:
        assert marker not in solved_text and marker not in student_text
    for answer in answers:
        assert answer.strip() and answer in solved_text
        assert answer not in student_text, f"labs/{lab}.ipynb shows a model answer:\n{answer}"
    assert build.MODEL_ANSWER_STUB in student_text


def test_model_answer_regions_are_cut_from_the_student_copy():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "**Your answers**\n\n### BEGIN MODEL ANSWER\n1. the first read\n### END MODEL ANSWER\nafter")])
    assert build.without_model_answers(nb).cells[0].source == "**Your answers**\n\nYOUR ANSWER HERE\nafter"
    assert build.solution_notebook(nb).cells[0].source == "**Your answers**\n\n1. the first read\nafter"
    with pytest.raises(ValueError, match="no 'END MODEL ANSWER'"):
        build.model_answer_regions("### BEGIN MODEL ANSWER\nx")
    bad = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("### BEGIN MODEL ANSWER\n### END MODEL ANSWER")])
    assert "markdown cell" in build.model_answer_problems("99_x", bad)[0]


def test_report_counts_a_lab(tmp_path):
    """The report on a small master: a Predict without its variable, no measurement, no header table."""
    cells = [nbformat.v4.new_markdown_cell("# Lab 99\n\nGraded (1 points). `MINILLM_QUICK=1` is quick mode."),
             nbformat.v4.new_markdown_cell("*Predict* the time."),
             nbformat.v4.new_code_cell("x = 1"),
             nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION",
                                       metadata={"nbgrader": {"solution": True, "grade": False, "grade_id": "f",
                                                              "locked": False, "schema_version": 3}}),
             nbformat.v4.new_code_cell("assert f() == 1", metadata={"nbgrader": {
                 "solution": False, "grade": True, "grade_id": "test_f", "locked": True, "points": 1,
                 "schema_version": 3}})]
    path = tmp_path / "99_x" / "99_x.ipynb"
    path.parent.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    rep = report.report_lab("99_x", tmp_path)
    assert (rep.written, rep.run_only, rep.tests, rep.points) == (1, 1, 1, 1.0)
    text = "\n".join(rep.problems)
    for expected in ("a Predict with no predicted_* variable", "no measurement the learner writes",
                     "no checked short answer", "no model answers", "no points table"):
        assert expected in text
    assert "quick-mode" not in text and "does not say" not in text


def test_lab_time_counts_reading_writing_and_the_measured_run(tmp_path):
    """grading.timing on a small master: solution lines (no blanks, comments), words read (no solutions, no tests),
    the header's stated time against compute + reading + writing within 20%."""
    from grading import timing

    header = "# Lab 99\n\n**Time:** about 10 minutes."
    cells = [nbformat.v4.new_markdown_cell(header),
             nbformat.v4.new_markdown_cell(" ".join(["word"] * 360)),
             nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    # a comment\n\n    a = 1\n    return a\n"
                                       "    ### END SOLUTION",
                                       metadata={"nbgrader": {"solution": True, "grade": False, "grade_id": "f",
                                                              "locked": False, "schema_version": 3}}),
             nbformat.v4.new_code_cell("assert f() == 1 " * 50, metadata={"nbgrader": {
                 "solution": False, "grade": True, "grade_id": "test_f", "locked": True, "points": 1,
                 "schema_version": 3}})]
    path = tmp_path / "99_x" / "99_x.ipynb"
    path.parent.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    row = timing.estimate("99_x", tmp_path, times={})
    assert row["lines"] == 2 and row["writing_min"] == 2 * timing.MINUTES_PER_LINE
    assert row["words"] == 360 + len(timing.WORD.findall(header))
    assert row["stated_min"] == 10 and row["total_min"] is None
    assert "never measured" in timing.problems(row)[0]
    reading = row["words"] / timing.READING_WPM
    for compute_min, ok in ((10 - 3 - reading, True), (10 / 1.3 - 3 - reading, False), (10 / 0.75 - 3 - reading, False)):
        row = timing.estimate("99_x", tmp_path, times={"99_x": {"full_s": compute_min * 60, "measured_on": "here"}})
        assert (timing.problems(row) == []) is ok, (compute_min, timing.problems(row))


@pytest.mark.parametrize("lab", LABS)
def test_the_header_states_the_measured_time(lab):
    """Cell 0's time is within 20% of the full-mode run recorded in grading/full_times.json plus reading and writing."""
    from grading import timing

    row = timing.estimate(lab)
    if row["total_min"] is None:
        pytest.skip(f"{lab}'s full-mode run is not recorded yet (python -m grading.timing --measure {lab})")
    assert not timing.problems(row), timing.problems(row)
