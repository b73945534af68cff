"""Grading a whole class: one submission never costs another its grade, and a broken grader is an error, not a zero.

On the probe lab (tests/lab_utils.py: no model, seconds a notebook):
- a malformed notebook is its own row (status "error", the cause in words), and the other rows are what they
  are when graded alone;
- the preflight grades the lab's own solution and untouched copy first, and stops the run, before any row is
  written, when the sandbox cannot start or either scores what it must not;
- the grader's own failure partway is an "error" row without a score;
- the CSV grows row by row, and --resume finishes an interrupted run without regrading a row;
- nothing the submission sends back (the names it reports, what it raises after a hidden test saw its inputs)
  reaches a reason or a feedback page.
"""

from __future__ import annotations

import csv
from pathlib import Path

import nbformat
import pytest

from lab_utils import PROBE_LAB, write_probe_master

from grading import build, grader

SOLVED = "def double(x):\n    return 2 * x"
GRADE_SCRIPT = build.REPO_ROOT / "grading" / "autograde.py"

# Solves the lab, records every input it is given, and tries to send the hidden test's input (-3) back: in the
# names of references it reports to the grader, and in an error it raises once the hidden test has run.
LEAKS = """import sys
SEEN = []
def double(x):
    SEEN.append(x)
    if len(SEEN) > 3:
        raise ValueError(f"LEAKED inputs {SEEN}")
    return 2 * x
_runner = sys.modules.get("__main__")
if _runner is not None and hasattr(_runner, "_references_used"):
    _runner._references_used = lambda: [f"LEAKED {SEEN}"]
"""


def _autograde_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("autograde_script_class", GRADE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The probe lab's masters, its student copy and solution, and a function that writes a class."""
    root = tmp_path_factory.mktemp("class")
    source = root / "source"
    write_probe_master(source)
    rendered = build.render(source)
    student = nbformat.reads(rendered[f"labs/{PROBE_LAB}.ipynb"], as_version=4)

    def notebook(solution: str | None = None, edit=None) -> str:
        nb = nbformat.reads(nbformat.writes(student), as_version=4)
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("solution") and solution is not None:
                cell.source = solution
        if edit is not None:
            edit(nb)
        return nbformat.writes(nb)

    def write_class(folder: Path, texts: dict[str, str]) -> dict[str, dict[str, Path]]:
        found = {}
        for name, text in texts.items():
            path = folder / name / PROBE_LAB / f"{PROBE_LAB}.ipynb"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            found[name] = {PROBE_LAB: path}
        return found

    return {"root": root, "source": source, "notebook": notebook, "write_class": write_class}


@pytest.fixture(scope="module")
def probe_course(probe):
    return grader.prepare_course(probe["root"] / "course", [PROBE_LAB], probe["source"])


def _key(row: dict) -> tuple:
    return row["status"], row["score"], row["max_score"], sorted(row["failures"]), row["reason"]


def _malformed(nb):
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "visible":
            cell.metadata["nbgrader"]["grade_id"] = ["visible"]


@pytest.mark.parametrize("edit, expected", [
    (lambda nb: nb.cells.insert(0, nbformat.v4.new_code_cell("x = 1", metadata={"nbgrader": {
        "grade_id": "bonus", "grade": True, "points": 10, "solution": False, "locked": True}})),
     "cell 1: grade_id 'bonus' is not a cell of this lab (not run)"),
    (lambda nb: nb.cells.append(nbformat.v4.new_code_cell("def double(x):\n    return 0", metadata={
        "nbgrader": {"grade_id": "double", "solution": True, "grade": False, "locked": False}})),
     "appears again (cell"),
    (lambda nb: nb.cells.reverse(), "graded cells reordered: quick_mode comes before double"),
    (lambda nb: next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "hidden")
     .metadata["nbgrader"].update(points=100), "the nbgrader metadata of hidden was edited (the lab's is used)"),
    (lambda nb: next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "double")
     .metadata.update(nbgrader="double"), "nbgrader metadata is a string, expected an object"),
    (lambda nb: next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "visible")
     .metadata["nbgrader"].update(points="4"), "nbgrader points is a string, expected a number"),
    (lambda nb: nb.cells[0].update(source=7), "source is a number, expected a string or a list of strings"),
])
def test_cells_are_checked_against_the_master(probe, probe_course, edit, expected):
    """Unknown, duplicated, reordered and re-flagged graded cells are named; malformed ones make the notebook
    an error (SubmissionError) with the cell's number and what was expected."""
    courses = probe_course
    nb = nbformat.reads(probe["notebook"](SOLVED), as_version=4)
    edit(nb)
    try:
        found = grader.check_cells(nb, courses[PROBE_LAB])
    except grader.SubmissionError as error:
        found = [str(error)]
    assert any(expected in line for line in found), found
    untouched = nbformat.reads(probe["notebook"](SOLVED), as_version=4)
    assert grader.check_cells(untouched, courses[PROBE_LAB]) == []


def test_the_preflight_stops_a_sandbox_that_cannot_start_before_any_row(probe, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(grader, "SANDBOX_PYTHON", "/nonexistent/minillm/python3")
    submitted = probe["write_class"](tmp_path / "submitted", {"ada": probe["notebook"](SOLVED)})
    out = tmp_path / "grades.csv"
    status = _autograde_main()([str(tmp_path / "submitted"), "--source", str(probe["source"]), "--out", str(out),
                                "--jobs", "1"])
    err = capsys.readouterr().err
    assert status == 2 and submitted
    assert not out.exists(), "a broken setup wrote grades"
    line = next(l for l in err.splitlines() if l.startswith("autograde: preflight failed"))
    assert "sandbox: cannot execute the kernel's python inside the sandbox" in line, err
    # without the preflight (a sandbox that breaks mid-run), the notebook is an error row, never a graded 0
    (row,) = grader.autograde(submitted, source_dir=probe["source"], jobs=1, preflight=False)
    assert (row["status"], row["score"]) == ("error", None), row
    assert row["reason"].startswith("sandbox: cannot execute the kernel's python inside the sandbox (bwrap: execvp"), row


def _master(source: Path, lab: str, grade_id: str, cell_source: str) -> None:
    """The probe master as lab ``lab`` in the folder of masters ``source``, cell ``grade_id`` rewritten."""
    nb = nbformat.read(write_probe_master(source / "tmp"), as_version=4)
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id:
            cell.source = cell_source
    (source / lab).mkdir(parents=True)
    nbformat.write(nb, source / lab / f"{lab}.ipynb")
    import shutil

    shutil.rmtree(source / "tmp")


def test_the_preflight_names_every_lab_whose_solution_or_untouched_copy_grades_wrong(probe, tmp_path):
    """A master whose visible test fails with its own solution, one whose untouched copy earns a point: the run
    stops before any row, naming both."""
    source, labs = tmp_path / "source", ("97_broken", "98_free")
    _master(source, labs[0], "visible", "assert double(2) == 5")
    _master(source, labs[1], "quick_mode", 'assert os.environ.get("MINILLM_QUICK") == "1"')
    submissions = {"ada": {}}
    for lab in labs:
        path = submissions["ada"][lab] = tmp_path / "submitted" / "ada" / lab / f"{lab}.ipynb"
        path.parent.mkdir(parents=True)
        path.write_text(probe["notebook"](SOLVED), encoding="utf-8")
    with pytest.raises(grader.PreflightFailed) as failed:
        grader.autograde(submissions, source_dir=source, jobs=2, out_csv=tmp_path / "a.csv")
    message = str(failed.value)
    assert "97_broken's own solution scored 3 of 4 in the sandbox (visible: AssertionError" in message, message
    assert "98_free's untouched student copy scored 1, not 0" in message, message
    assert "\n" not in message and not (tmp_path / "a.csv").exists()


# --- one class, interrupted and resumed: a malformed notebook, a grader failure, a submission that leaks ------


@pytest.fixture(scope="module")
def resumed(probe, tmp_path_factory):
    """Run 1 grades s0-s3 (untouched, solved, untouched, solved) and is interrupted after two rows. Run 2
    resumes it with three more students: a malformed notebook, one whose nbgrader step fails (the grader's
    machinery), one that tries to leak the hidden test's input."""
    root = tmp_path_factory.mktemp("resumed")
    notebook = probe["notebook"]
    texts = {f"s{n}": notebook(SOLVED if n % 2 else None) for n in range(4)}
    more = {"bad": notebook(SOLVED, _malformed), "broken": notebook(SOLVED), "leaks": notebook(LEAKS)}
    submissions = probe["write_class"](root / "submitted", {**texts, **more})
    first = {s: submissions[s] for s in texts}
    out = root / "grades.csv"
    real_grade, real_nbgrader, graded, again = grader._grade, grader._nbgrader_autograde, [], []
    kwargs = dict(source_dir=probe["source"], jobs=1, out_csv=out, preflight=False, feedback_dir=root / "feedback",
                  log_dir=root / "logs", cell_timeout_s=20)

    def interrupted(run, student, lab, path):
        if len(graded) == 2:
            raise KeyboardInterrupt
        graded.append(student)
        return real_grade(run, student, lab, path)

    def nbgrader_fails_for_broken(course_root, lab, student, env, log_path):
        if student == "broken":
            log_path.write_text("nbgrader crashed\n", encoding="utf-8")
            return None
        return real_nbgrader(course_root, lab, student, env, log_path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grader, "_grade", interrupted)
        with pytest.raises(KeyboardInterrupt):
            grader.autograde(first, **kwargs)
    with open(out, newline="", encoding="utf-8") as handle:
        kept = [row["student"] for row in csv.DictReader(handle)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grader, "_grade", lambda run, s, lab, path: again.append(s) or real_grade(run, s, lab, path))
        patch.setattr(grader, "_nbgrader_autograde", nbgrader_fails_for_broken)
        rows = grader.autograde(submissions, resume=True, **kwargs)
    with open(out, newline="", encoding="utf-8") as handle:
        written = {row["student"]: row for row in csv.DictReader(handle)}
    return {"root": root, "kept": kept, "graded": graded, "again": again, "texts": {**texts, **more},
            "rows": {row["student"]: row for row in rows}, "csv": written}


def test_an_interrupted_run_keeps_its_rows_and_resumes_without_regrading(resumed):
    assert resumed["kept"] == resumed["graded"] == ["s0", "s1"], "the rows done before the interruption are in the CSV"
    assert sorted(resumed["again"]) == ["bad", "broken", "leaks", "s2", "s3"], "resume regraded a row it had"
    assert [(s, r["score"]) for s, r in resumed["csv"].items() if s.startswith("s")] == [
        ("s0", "0"), ("s1", "4"), ("s2", "0"), ("s3", "4")]


def test_a_malformed_notebook_is_its_own_error_row_and_the_others_score_as_alone(resumed):
    rows = resumed["rows"]
    number = 1 + next(i for i, c in enumerate(nbformat.reads(resumed["texts"]["bad"], as_version=4).cells)
                      if isinstance(c.metadata.get("nbgrader", {}).get("grade_id"), list))
    assert (rows["bad"]["status"], rows["bad"]["score"]) == ("error", None)
    assert rows["bad"]["reason"] == f"cell {number}: grade_id is a list, expected a string", rows["bad"]["reason"]
    # s2 and s3 were graded beside the malformed, the failing and the leaking notebooks; s0 and s1 before them
    assert _key(rows["s2"]) == ("graded", 0.0, 4.0, ["hidden", "quick_mode", "visible"],
                                "visible: NotImplementedError\nhidden: NotImplementedError\nquick_mode: NotImplementedError")
    assert _key(rows["s3"]) == ("graded", 4.0, 4.0, [], "")
    assert [resumed["csv"][s]["reason"] for s in ("s0", "s1")] == [rows["s2"]["reason"], rows["s3"]["reason"]]


def test_the_graders_own_failure_partway_is_an_error_not_a_zero(resumed):
    row = resumed["rows"]["broken"]
    assert (row["status"], row["score"]) == ("error", None)
    assert row["reason"] == "nbgrader autograde wrote no notebook; see the log"
    assert (resumed["csv"]["broken"]["status"], resumed["csv"]["broken"]["score"]) == ("error", ""), "an error got a score"
    page = (resumed["root"] / "feedback" / "broken" / PROBE_LAB / f"{PROBE_LAB}.html").read_text(encoding="utf-8")
    assert "Not graded: nbgrader autograde wrote no notebook" in page and "Score" not in page


def test_nothing_the_submission_sends_back_reaches_a_reason_or_feedback(resumed):
    row = resumed["rows"]["leaks"]
    page = (resumed["root"] / "feedback" / "leaks" / PROBE_LAB / f"{PROBE_LAB}.html").read_text(encoding="utf-8")
    assert row["score"] == 3.0, row   # it solves the lab: the quick-mode test after the hidden one raises
    for text in (row["reason"], resumed["csv"]["leaks"]["reason"], page):
        assert "LEAKED" not in text and "-3" not in text, text
    assert "quick_mode: ValueError (message withheld: hidden tests had run before it" in row["reason"], row["reason"]
    assert "LEAKED inputs [2, 0, -3, 2]" in row["failures"]["quick_mode"], "the instructor's row keeps the message"
    assert "LEAKED inputs [2, 0, -3, 2]" in Path(row["log"]).read_text(encoding="utf-8")


def test_summary_and_estimate_say_what_an_instructor_needs():
    rows = [
        {"student": "a", "lab": "02_kv_cache", "status": "graded", "score": 17.0, "max_score": 17.0, "seconds": 40.0,
         "failures": {}, "reason": ""},
        {"student": "b", "lab": "02_kv_cache", "status": "graded", "score": 3.0, "max_score": 17.0, "seconds": 90.0,
         "failures": {"test_a": "x", "test_b": "y"}, "reason": "test_a: x"},
        {"student": "c", "lab": "02_kv_cache", "status": "error", "score": None, "max_score": 17.0, "seconds": 1.0,
         "failures": {}, "reason": "cell 3: grade_id is a list, expected a string"},
        {"student": "d", "lab": "02_kv_cache", "status": "graded", "score": 0.0, "max_score": 17.0, "seconds": 50.0,
         "failures": {"test_a": "x"}, "reason": "test_a: x"},
    ]
    text = grader.summary(rows, top=2)
    assert "4 notebooks: 1 error, 3 graded" in text
    assert "median 50 s, longest 90 s" in text
    assert "slowest: b / 02_kv_cache 90 s, d / 02_kv_cache 50 s" in text
    assert "most failed tests: 02_kv_cache:test_a (2), 02_kv_cache:test_b (1)" in text
    assert "error: c / 02_kv_cache: cell 3: grade_id is a list" in text
    todo = [("a", "02_kv_cache", None)] * 30
    line = grader.estimate(todo, 2, {"02_kv_cache": {"quick_s": 40.0}})
    assert line.startswith("estimate: 30 notebooks at about 40 s each") and line.endswith("2 at a time: about 10 min")


def test_default_jobs_follow_the_cores_and_the_memory(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else (16 << 30) // 4096)
    assert grader.default_jobs() == 2   # 60% of 16 GiB holds two 4 GiB notebooks, though there are 8 cores
    monkeypatch.setattr(os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else (256 << 30) // 4096)
    assert grader.default_jobs() == 8
