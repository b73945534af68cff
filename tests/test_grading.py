"""Autograding a batch the way an instructor meets it: one corrupt notebook, one that calls
os._exit, one that loops, one that crashes the kernel, one with tests deleted or emptied, one
cheat, one solved; every notebook gets its row, the others keep their points.

The probe lab (tests/lab_utils.py) needs no model, so its batch is cheap; lab 00's batch shows
the same on a real lab with several exercises (points kept before and after a kernel death).
"""

from __future__ import annotations

import contextlib
import csv
import io
import re
import time
import uuid
from pathlib import Path

import nbformat
import pytest

import cheats
from lab_utils import PROBE_LAB, write_probe_master

from grading import build, grader

REPO_ROOT = build.REPO_ROOT
GRADE_SCRIPT = REPO_ROOT / "grading" / "autograde.py"
HIDDEN_PROBE_LINE = "assert double(-3) == -6"
SEGFAULT = "import numpy as np\nnp.lib.stride_tricks.as_strided(np.zeros(1), shape=(2,), strides=(10**12,)).sum()\n"


def _import_autograde_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("autograde_script", GRADE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _set_solution(nb, grade_id: str, source: str):
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id:
            cell.source = source
            return nb
    raise KeyError(grade_id)


def _write(folder: Path, student: str, lab: str, text: str) -> Path:
    path = folder / student / lab / f"{lab}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --- the probe batch, through the instructor's command ---------------------------------------

VISIBLE_ONLY = "def double(x):\n    return 4 if x == 2 else 0"   # passes the visible test, not the hidden one


@pytest.fixture(scope="module")
def probe_batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-batch")
    source_dir = root / "source"
    write_probe_master(source_dir)
    rendered = build.render(source_dir)
    student, solution = rendered[f"labs/{PROBE_LAB}.ipynb"], rendered[f"solutions/{PROBE_LAB}.ipynb"]
    marker, token = root / "cheated", f"minillm-cheat-{uuid.uuid4().hex}"
    course = root / "course"

    def variant(edit):
        nb = nbformat.reads(student, as_version=4)
        edit(nb)
        return nbformat.writes(nb)

    def tamper(nb):
        tests = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
        tests[0].source = "pass"
        nb.cells.remove(tests[1])
        _set_solution(nb, "double", "def double(x):\n    return 2 * x")

    def transformer(nb):
        nb.cells.insert(1, nbformat.v4.new_code_cell(
            "def wrap(lines):\n    return ['try:\\n'] + ['    ' + l for l in lines] + ['\\nexcept BaseException:\\n    pass\\n']\n"
            "get_ipython().input_transformers_post.append(wrap)"))

    def cheat(*attempts, then=VISIBLE_ONLY):
        return variant(lambda nb: _set_solution(nb, "double", "\n".join(cheats._guarded(a) for a in attempts) + "\n" + then))

    submissions = root / "submitted"
    notebooks = {
        "solved": solution,
        "untouched": student,
        "looping": variant(lambda nb: _set_solution(nb, "double", "def double(x):\n    while True:\n        pass")),
        "exits": variant(lambda nb: _set_solution(nb, "double", "import os\nos._exit(0)\ndef double(x):\n    return 2 * x")),
        "crashes": variant(lambda nb: _set_solution(nb, "double", SEGFAULT + "def double(x):\n    return 2 * x")),
        "tampers": variant(tamper),
        "cheats": variant(transformer),
        "visible_only": variant(lambda nb: _set_solution(nb, "double", VISIBLE_ONLY)),
        # every cheat of a class, then the visible-only answer: each must score what visible_only scores
        "screened_cheats": cheat(*cheats.SCREENED_CHEATS.values()),
        "evasions": cheat(cheats.evasions("common")),
        "ipython_hooks": cheat(cheats.IPYTHON_HOOKS),
        "reaches_the_course": cheat(cheats.reaching_the_course(PROBE_LAB, course, marker)),
        "outlives": cheat(cheats.outliving(token, marker)),
        # an answer that claims to be torch's or the lab helpers' own: refused as not plain data
        "spoofs_provenance": cheat(cheats.SPOOFED_PROVENANCE, then="def double(x):\n    return Tensorish()"),
        # detects grading and cheats only then (here: an object equal to anything)
        "detects_grading": cheat(cheats.DETECTING, cheats.evasions("common"),
                                 then="def double(x):\n    return Always() if GRADED else 2 * x"),
    }
    for name, text in notebooks.items():
        _write(submissions, name, PROBE_LAB, text)
    _write(submissions, "corrupt", PROBE_LAB, student[: len(student) // 2])
    (submissions / "missing" / PROBE_LAB).mkdir(parents=True)  # a lab folder without its notebook
    out = root / "grades.csv"
    started = time.monotonic()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # --jobs left to its default: what the cores and memory allow
        status = _import_autograde_script().main(
            [str(submissions), "--source", str(source_dir), "--out", str(out), "--feedback", str(root / "feedback"),
             "--cell-timeout", "8", "--keep", str(course)])
    with open(out, newline="", encoding="utf-8") as handle:
        rows = {row["student"]: row for row in csv.DictReader(handle)}
    return {"status": status, "rows": rows, "root": root, "out": out, "marker": marker, "token": token,
            "course": course, "seconds": time.monotonic() - started, "printed": printed.getvalue()}


CHEATERS = ("screened_cheats", "evasions", "ipython_hooks", "reaches_the_course", "outlives", "spoofs_provenance",
            "detects_grading")


def test_every_notebook_of_the_batch_gets_a_row_with_its_reason(probe_batch):
    rows = probe_batch["rows"]
    assert set(rows) == {"solved", "untouched", "looping", "exits", "crashes", "tampers", "cheats", "visible_only",
                         "corrupt", "missing", *CHEATERS}
    scores = {name: (row["status"], float(row["score"]) if row["score"] else None, float(row["max_score"]))
              for name, row in rows.items()}
    assert scores == {
        "solved": ("graded", 4.0, 4.0),
        "untouched": ("graded", 0.0, 4.0),   # every test calls the exercise
        "looping": ("graded", 0.0, 4.0),
        "exits": ("graded", 0.0, 4.0),
        "crashes": ("graded", 0.0, 4.0),
        "tampers": ("graded", 1.0, 4.0),     # solved, but its two tests were deleted / emptied
        "cheats": ("graded", 0.0, 4.0),
        "visible_only": ("graded", 2.0, 4.0),
        "screened_cheats": ("graded", 2.0, 4.0),
        "evasions": ("graded", 2.0, 4.0),
        "ipython_hooks": ("graded", 2.0, 4.0),
        "reaches_the_course": ("graded", 2.0, 4.0),
        "outlives": ("graded", 2.0, 4.0),
        "spoofs_provenance": ("graded", 0.0, 4.0),
        "detects_grading": ("graded", 0.0, 4.0),
        "corrupt": ("error", None, 4.0),     # no score: an error is never a zero
        "missing": ("error", None, 4.0),
    }, scores
    reasons = {name: row["reason"] for name, row in rows.items()}
    general = {name: reason.split("\n")[0] for name, reason in reasons.items()}
    assert reasons["solved"] == ""
    assert reasons["untouched"].splitlines() == [
        "visible: NotImplementedError", "hidden: NotImplementedError", "quick_mode: NotImplementedError"], reasons["untouched"]
    assert re.fullmatch(r"invalid notebook JSON at byte \d+ \(line \d+, column \d+\): .+", reasons["corrupt"]), reasons["corrupt"]
    assert reasons["missing"].startswith("no notebook at ")
    assert "cell visible timed out" in general["looping"] and "cell hidden timed out" in general["looping"]
    assert general["exits"] == "the sandbox died in cell double"
    assert general["crashes"] == "the sandbox died in cell double"
    assert "locked cell visible was changed" in general["tampers"] and "locked cell hidden was deleted" in general["tampers"]
    # one line per failed test after the notes: its name and the first line of what a student may read
    assert reasons["visible_only"] == "hidden: a hidden test failed (AssertionError)", reasons["visible_only"]
    assert "refused in visible: a value that is not plain data" in general["spoofs_provenance"], reasons["spoofs_provenance"]
    for name, reason in reasons.items():
        assert all(len(line) <= 300 for line in reason.splitlines()), (name, reason)
        assert "def double(x)" not in reason and "return 2 * x" not in reason, (name, reason)  # never the source
    assert probe_batch["status"] == 2, "the exit status counts the notebooks that could not be graded"
    printed = probe_batch["printed"]
    jobs = grader.default_jobs()
    assert f"autograding 17 notebooks from 17 students, {jobs} at a time" in printed, printed
    assert re.search(rf"estimate: 17 notebooks at about \d+ s each .*, {jobs} at a time: about \d+", printed), printed
    assert "17 notebooks: 2 error, 15 graded" in printed and "most failed tests: 99_probe:hidden (" in printed, printed
    with open(probe_batch["out"], encoding="utf-8") as handle:
        assert handle.readline().strip() == ",".join(grader.CSV_FIELDS)


def test_nothing_a_submission_did_outlives_its_grading_or_reaches_the_course(probe_batch):
    """The detached processes of `outlives` (setsid, double fork) died with their sandbox: nothing of the batch
    runs after it, and nothing wrote the marker (outside the sandbox) or the repository, then or later."""
    import subprocess

    left = max(0.0, 9.0 - probe_batch["seconds"])  # the cheats write after 6-7 s: wait past that
    time.sleep(left)
    running = subprocess.run(["pgrep", "-f", probe_batch["token"]], capture_output=True, text=True)
    assert running.stdout.strip() == "", f"processes of a graded submission still run: {running.stdout}"
    assert not probe_batch["marker"].exists(), probe_batch["marker"].read_text()
    assert not (REPO_ROOT / "SANDBOX_ESCAPED").exists() and not (REPO_ROOT / "grades.csv").exists()


def test_scores_come_only_from_the_autograded_cells(probe_batch):
    """A manual score in the gradebook that did not come from the formgrader (here written straight into the
    kept course's gradebook, as a kernel that could reach it would have) is ignored and named."""
    from nbgrader.api import Gradebook

    with Gradebook("sqlite:///" + str(probe_batch["course"] / "gradebook.db"), grader.COURSE_ID) as gradebook:
        grade = gradebook.find_grade("hidden", PROBE_LAB, PROBE_LAB, "untouched")
        assert grade.manual_score is None, "a manual score in a fresh gradebook"
        grade.manual_score = 2.0
        gradebook.db.commit()
        score, max_score, manual_max, notes = grader._scores(gradebook, PROBE_LAB, "untouched", {})
    assert (score, max_score, manual_max) == (0.0, 4.0, 0.0)
    assert notes == ["ignored a manual score on hidden that did not come from the formgrader"]


def test_the_batch_keeps_each_log_and_writes_feedback_without_hidden_tests(probe_batch):
    root = probe_batch["root"]
    logs = root / "grades.logs"
    for student, row in probe_batch["rows"].items():
        log = logs / student / f"{PROBE_LAB}.log"
        assert log.is_file(), f"no log for {student}"
        page = (root / "feedback" / student / PROBE_LAB / f"{PROBE_LAB}.html").read_text(encoding="utf-8")
        assert HIDDEN_PROBE_LINE not in page and "HIDDEN TESTS" not in page and "-6" not in page, student
        if row["status"] == "graded":
            assert f"{float(row['score']):g} / {float(row['max_score']):g}" in page
        else:
            assert "Not graded" in page and "Score" not in page, student
    nbgrader_log = (logs / "solved" / f"{PROBE_LAB}.log").read_text(encoding="utf-8")
    assert "AutogradeApp" in nbgrader_log and "checksum" not in nbgrader_log, "an untouched test cell logged a checksum change"
    crashed = (root / "feedback" / "crashes" / PROBE_LAB / f"{PROBE_LAB}.html").read_text(encoding="utf-8")
    assert "the sandbox died in cell double" in crashed


# --- lab 00: partial work, a crash in one exercise ------------------------------------------------

LAB = "00_setup"


@pytest.fixture(scope="module")
def lab00_batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab00-batch")
    solution = nbformat.read(REPO_ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
    student = nbformat.read(REPO_ROOT / "labs" / f"{LAB}.ipynb", as_version=4)
    stub = {c.metadata["nbgrader"]["grade_id"]: c.source for c in student.cells if c.metadata.get("nbgrader", {}).get("solution")}
    solved = {c.metadata["nbgrader"]["grade_id"]: c.source for c in solution.cells if c.metadata.get("nbgrader", {}).get("solution")}
    assert sorted(solved) == ["answer_decode_90", "count_tokens", "e2e_latency", "measure_rates", "tokens_per_second"]

    def notebook(**sources):
        nb = nbformat.read(REPO_ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
        for grade_id, source in sources.items():
            _set_solution(nb, grade_id, source)
        return nbformat.writes(nb)

    texts = {
        "half": notebook(tokens_per_second=stub["tokens_per_second"]),
        "crash_first": notebook(count_tokens=SEGFAULT + solved["count_tokens"]),
    }
    paths = {name: {LAB: _write(root / "submitted", name, LAB, text)} for name, text in texts.items()}
    rows = grader.autograde(paths, feedback_dir=root / "feedback", preflight=False)  # the probe batch runs it
    return {row["student"]: row for row in rows}


def test_half_solved_lab_earns_exactly_its_points(lab00_batch):
    row = lab00_batch["half"]   # the measurement uses tokens_per_second: its 2 points go too
    assert (row["status"], row["score"], row["max_score"]) == ("graded", 5.0, 9.0), row
    assert set(row["failures"]) == {"test_tokens_per_second", "test_tokens_per_second_more", "test_measure_rates"}


def test_a_kernel_death_costs_only_its_exercise(lab00_batch):
    """The sandbox dies in the first exercise; a fresh one replays the cells before it, and the
    later exercises still earn their points."""
    row = lab00_batch["crash_first"]
    assert (row["status"], row["score"], row["max_score"]) == ("graded", 7.0, 9.0), row
    assert row["reason"].splitlines()[0] == "the sandbox died in cell count_tokens", row["reason"]
    assert sorted(line.split(":")[0] for line in row["reason"].splitlines()[1:]) == sorted(row["failures"])
    assert set(row["failures"]) == {"test_count_tokens", "test_count_tokens_engine"}


@pytest.mark.slow  # the loop costs three per-cell timeouts (the measurement calls it too)
def test_a_looping_exercise_costs_only_its_tests(tmp_path):
    """tokens_per_second never returns: its two tests and the measurement that uses it are interrupted at the
    lab's measured per-cell limit, the other exercises earn their points."""
    nb = nbformat.read(REPO_ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
    _set_solution(nb, "tokens_per_second", "def tokens_per_second(num_tokens, seconds):\n    while True:\n        pass")
    path = _write(tmp_path, "loops", LAB, nbformat.writes(nb))
    (row,) = grader.autograde({"loops": {LAB: path}}, preflight=False)
    assert (row["status"], row["score"], row["max_score"]) == ("graded", 5.0, 9.0), row
    assert set(row["failures"]) == {"test_tokens_per_second", "test_tokens_per_second_more", "test_measure_rates"}
    # a plain cell that calls it later times out too (it is named by position)
    assert ("cell test_tokens_per_second timed out in the sandbox; cell test_tokens_per_second_more timed out in the sandbox"
            in row["reason"]), row["reason"]
