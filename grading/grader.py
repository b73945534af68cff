"""Autograde lab submissions with nbgrader; one row per (student, lab), whatever the notebook does.

The course is rebuilt from the instructor masters (grading/source) each time, so the tests and
the hidden tests come from the masters, never from what a student hands in. From a submission
only the **solution cells** are taken (matched by nbgrader ``grade_id``); every other cell comes
from the master, and the student's own extra cells are not run. Each solution cell is screened
as source first (grading/screen.py): one that could change how later cells run or what the
checks do is replaced by the stub and named in the row. The graded copy carries a runtime guard
(grading/guard.py) as its first cell and a check of it at the top of every test cell.

Then ``nbgrader autograde`` runs once per (student, lab), headless, in quick mode
(``MINILLM_QUICK=1``), with nbgrader's Execute replaced by grading.execute (a dead
kernel costs the cell that killed it, not the lab). A test cell the student deleted or changed
scores 0, and so does one during which the guard saw a change; the row says so.

    rows = autograde({"ada": {"01_prefill_decode": "ada/01_prefill_decode.ipynb"}})
    # [{"student": "ada", "lab": "01_prefill_decode", "status": "graded", "score": 6.0,
    #   "max_score": 6.0, "reason": "", "failures": {}, ...}]
"""

from __future__ import annotations

import ast
import copy
import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from grading import guard, screen
from grading.build import (GRADING_DIR, REMOVED_REGIONS, REPO_ROOT, SOURCE_DIR, discover_labs, dumps, generate_assignments,
                           make_course, read_master, without_model_answers)
from grading.execute import REPORT_ENV as EXECUTE_REPORT_ENV

STUDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*")
COURSE_ID = "minillm"
# The interpreter that runs nbgrader also runs the kernel ("python3" kernelspec -> sys.executable).
PYTHON = sys.executable

GUARD_CELL_ID = "minillm_grading_guard"
GUARD_SOURCE = "import grading.guard as _minillm_guard\n_minillm_guard.install(get_ipython())"
STUB = "raise NotImplementedError(\"minillm grading: this solution cell was not run (the grade's reason says why)\")"
HIDDEN_BEGIN, HIDDEN_END = REMOVED_REGIONS[0]  # the markers build.py cuts out of labs/ and solutions/

# Per-cell limit and quick-mode reference per lab, measured by `python grading/autograde.py --measure`.
QUICK_TIMES = GRADING_DIR / "quick_times.json"
TIMEOUT_PER_SLOWEST_CELL = 5  # a cell may take 5x the solution's slowest cell (a slower machine) ...
MIN_CELL_TIMEOUT_S = 60       # ... and at least a minute
DEFAULT_CELL_TIMEOUT_S = 900  # a lab never measured: grading/nbgrader_config.py's limit


# --- the graded copy ---------------------------------------------------------------------------


def _nbgrader(cell) -> dict:
    metadata = cell.get("metadata") if isinstance(cell, dict) else None
    meta = metadata.get("nbgrader") if isinstance(metadata, dict) else None
    return meta if isinstance(meta, dict) else {}


def _is_test(cell) -> bool:
    meta = _nbgrader(cell)
    return cell.cell_type == "code" and bool(meta.get("grade")) and not meta.get("solution")


def _import_lines(master) -> list[str]:
    """The top-level imports of the master's own code cells, to run again at the top of each test
    cell (a name the tests use is then the module again, whatever a cell bound to it)."""
    lines: list[str] = []
    for cell in master.cells:
        if cell.cell_type != "code" or _nbgrader(cell).get("solution"):
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not any(a.name == "*" for a in node.names):
                line = ast.unparse(node)
                if line not in lines:
                    lines.append(line)
    return lines


def preamble(grade_id: str, imports: list[str]) -> str:
    """The lines the graded copy puts at the top of test cell ``grade_id``."""
    return "\n".join([f"import grading.guard as _minillm_guard; _minillm_guard.verify({grade_id!r})", *imports]) + "\n"


def grading_master(master) -> nbformat.NotebookNode:
    """The master as the grading course holds it: the guard cell first, the preamble on every test."""
    nb = copy.deepcopy(master)
    imports = _import_lines(master)
    for cell in nb.cells:
        if _is_test(cell):
            cell.source = preamble(_nbgrader(cell)["grade_id"], imports) + cell.source
    guard_cell = nbformat.v4.new_code_cell(
        GUARD_SOURCE,
        id=GUARD_CELL_ID,
        metadata={"nbgrader": {"grade": False, "solution": False, "locked": True, "grade_id": GUARD_CELL_ID,
                               "schema_version": 3}},
    )
    nb.cells.insert(0, guard_cell)
    return nb


@dataclass
class LabCourse:
    """What grading one lab needs from the grading course."""

    name: str
    release: nbformat.NotebookNode          # the grading release: guard cell, preambles, no hidden tests
    sources: dict[str, tuple[str, str]]     # grade_id -> (gradebook source with hidden tests, checksum)
    preambles: dict[str, str]               # test grade_id -> its preamble
    protected: set[str] = field(default_factory=set)
    modules: set[str] = field(default_factory=set)
    max_score: float = 0.0

    def student_source(self, cell) -> str:
        """What this locked cell reads in the student's copy (labs/NN_topic.ipynb)."""
        return cell.source[len(self.preambles.get(_nbgrader(cell).get("grade_id"), "")):]

    def hidden_lines(self) -> list[str]:
        """Every line of every hidden test of this lab (for keeping them out of feedback)."""
        lines = []
        for source, _ in self.sources.values():
            numbered = source.split("\n")
            lines += [numbered[n - 1].strip() for n in sorted(hidden_line_numbers(source))
                      if numbered[n - 1].strip() and HIDDEN_BEGIN not in numbered[n - 1] and HIDDEN_END not in numbered[n - 1]]
        return lines


def hidden_line_numbers(source: str) -> set[int]:
    """1-based numbers of the lines of a test cell's hidden-test regions, marker lines included."""
    numbers, inside = set(), False
    for number, line in enumerate(source.split("\n"), 1):
        if HIDDEN_BEGIN in line:
            inside = True
        if inside:
            numbers.add(number)
        if HIDDEN_END in line:
            inside = False
    return numbers


def protected_names(master) -> tuple[set[str], set[str]]:
    """(names the master's own code cells bind, those bound to modules): what a solution cell may
    not rebind or write into (grading/screen.py)."""
    protected, modules = set(), set()
    for cell in master.cells:
        if cell.cell_type == "code" and not _nbgrader(cell).get("solution"):
            bound, bound_modules = screen.names_bound_by(cell.source)
            protected |= bound
            modules |= bound_modules
    return protected, modules


def prepare_course(course_root: Path, labs: list[str], source_dir: Path = SOURCE_DIR) -> dict[str, LabCourse]:
    """A throwaway nbgrader course at ``course_root`` whose masters carry the guard; assignments
    generated (gradebook: graded cells, hidden tests). Returns what grading each lab needs."""
    from nbgrader.api import Gradebook

    make_course(course_root, labs, source_dir)
    masters = {}
    for lab in labs:
        masters[lab] = read_master(lab, source_dir)
        graded = grading_master(without_model_answers(masters[lab]))
        (course_root / "source" / lab / f"{lab}.ipynb").write_text(dumps(graded), encoding="utf-8")
    released = generate_assignments(course_root, labs)
    courses = {}
    with Gradebook("sqlite:///" + str(course_root / "gradebook.db"), COURSE_ID) as gradebook:
        for lab in labs:
            release = nbformat.read(released[lab], as_version=4)
            imports = _import_lines(masters[lab])
            sources, preambles = {}, {}
            for cell in release.cells:
                grade_id = _nbgrader(cell).get("grade_id")
                if grade_id and _nbgrader(cell).get("locked"):
                    source_cell = gradebook.find_source_cell(grade_id, lab, lab)
                    sources[grade_id] = (source_cell.source, source_cell.checksum)
                if _is_test(cell):
                    preambles[grade_id] = preamble(grade_id, imports)
            protected, modules = protected_names(masters[lab])
            courses[lab] = LabCourse(lab, release, sources, preambles, protected, modules,
                                     float(gradebook.find_assignment(lab).max_score))
    return courses


class SubmissionError(Exception):
    """The file cannot be graded at all (the row's reason)."""


def read_submission(path: Path) -> nbformat.NotebookNode:
    """The notebook at ``path``, or SubmissionError naming what is wrong (with the byte offset)."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SubmissionError(f"not UTF-8 text at byte {error.start}") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        byte = len(text[: error.pos].encode("utf-8"))
        raise SubmissionError(f"invalid notebook JSON at byte {byte} (line {error.lineno}, column {error.colno}): {error.msg}") from None
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as error:  # nbformat's reader errors are several types
        raise SubmissionError(f"not a Jupyter notebook: {type(error).__name__}: {error}") from None
    if not isinstance(nb.get("cells"), list):
        raise SubmissionError("not a Jupyter notebook: no list of cells")
    return nb


@dataclass
class GradedCopy:
    notebook: nbformat.NotebookNode
    flags: list[str]          # integrity findings: screened cells, changed or deleted locked cells
    zeroed: dict[str, str]    # test grade_id -> why it scores 0 whatever it does
    notes: list[str]          # informational: extra cells not run


def graded_copy(submission: nbformat.NotebookNode, lab: LabCourse) -> GradedCopy:
    """The notebook nbgrader runs: the grading release with the student's solution cells put in
    (screened), the tests with their hidden parts and the checksums the gradebook holds."""
    by_id: dict[str, object] = {}
    for cell in submission.cells:
        grade_id = _nbgrader(cell).get("grade_id")
        if grade_id and grade_id not in by_id:
            by_id[grade_id] = cell
    release_ids = {_nbgrader(cell).get("grade_id") for cell in lab.release.cells} - {None}
    release_cell_ids = {cell.get("id") for cell in lab.release.cells}
    extra = sum(1 for cell in submission.cells
                if _nbgrader(cell).get("grade_id") not in release_ids and cell.get("id") not in release_cell_ids)
    flags, zeroed, notes = [], {}, []
    if extra:
        notes.append(f"{extra} cells of the submission are not part of the lab and were not run")
    nb = copy.deepcopy(lab.release)
    for cell in nb.cells:
        meta = _nbgrader(cell)
        grade_id = meta.get("grade_id")
        theirs = by_id.get(grade_id) if grade_id else None
        if meta.get("solution"):
            if not isinstance(theirs, dict) or theirs.get("cell_type") != cell.cell_type:
                flags.append(f"solution cell {grade_id} is missing from the submission")
                if cell.cell_type == "code":
                    cell.source = STUB
                continue
            source = theirs.get("source", "")
            source = "".join(source) if isinstance(source, list) else str(source)
            if cell.cell_type == "code":
                findings = screen.screen_source(source, lab.protected, lab.modules)
                if findings:
                    flags.append(f"solution cell {grade_id} was not run: {findings[0]}"
                                 + (f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""))
                    source = STUB
            cell.source = source
            continue
        if grade_id and grade_id in lab.sources:
            if grade_id != GUARD_CELL_ID and cell.cell_type == "code":  # locked markdown only explains
                expected = lab.student_source(cell)
                if theirs is None:
                    flags.append(f"locked cell {grade_id} was deleted")
                    if _is_test(cell):
                        zeroed[grade_id] = "this test cell was deleted from the submission"
                else:
                    got = theirs.get("source", "")
                    got = "".join(got) if isinstance(got, list) else str(got)
                    if got != expected:
                        flags.append(f"locked cell {grade_id} was changed")
                        if _is_test(cell):
                            zeroed[grade_id] = "this test cell was changed in the submission"
            cell.source, meta["checksum"] = lab.sources[grade_id]
    return GradedCopy(nb, flags, zeroed, notes)


# --- running nbgrader ----------------------------------------------------------------------------


def quick_times() -> dict[str, dict]:
    """``{lab: {"quick_s", "cells_s", "slowest_cell_s", "measured_on"}}`` from grading/quick_times.json:
    the solution's whole grading, its cells' share, its slowest cell (seconds, quick mode)."""
    try:
        return json.loads(QUICK_TIMES.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def cell_timeout_for(lab: str, times: Mapping[str, dict] | None = None) -> int:
    """Per-cell limit for grading ``lab`` in quick mode: 5x its solution's slowest cell, at least 60 s."""
    entry = (quick_times() if times is None else times).get(lab)
    if not entry:
        return DEFAULT_CELL_TIMEOUT_S
    return max(MIN_CELL_TIMEOUT_S, math.ceil(TIMEOUT_PER_SLOWEST_CELL * entry["slowest_cell_s"]))


def _kernel_env(quick: bool) -> dict[str, str]:
    env = dict(os.environ)
    # Creating the gradebook shells out to `alembic`, found on PATH only when the venv is active.
    env["PATH"] = os.pathsep.join([str(Path(PYTHON).parent), env.get("PATH", "")])
    # nbgrader (its config imports grading.execute) and the graded kernel (its first cell imports
    # grading.guard) run in the throwaway course folder: the grader's package is found from here.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if quick:
        env["MINILLM_QUICK"] = "1"
    else:
        env.pop("MINILLM_QUICK", None)
    # A learner's matplotlib/plotly settings must not change what the grader sees.
    env.pop("PYTHONSTARTUP", None)
    return env


def _errors(autograded_notebook: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Errors raised while grading, as ``{name: "ErrorName: message"}``: (graded test cells by
    grade_id, every code cell by grade_id or cell id)."""
    if not autograded_notebook.is_file():
        return {}, {}
    nb = nbformat.read(autograded_notebook, as_version=4)
    failures, errors = {}, {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        meta = _nbgrader(cell)
        name = meta.get("grade_id") or cell.get("id") or f"cell {index}"
        for output in cell.get("outputs", []):
            failed = output.get("output_type") == "error" or (
                output.get("output_type") == "stream" and output.get("name") == "stderr" and meta.get("grade"))
            if failed:
                message = (f"{output.get('ename')}: {output.get('evalue')}".strip() if output.get("output_type") == "error"
                           else "wrote to stderr (nbgrader counts it as a failure)")
                errors.setdefault(name, message)
                if meta.get("grade"):
                    failures.setdefault(name, message)
    return failures, errors


def _manual_max_score(submission) -> float:
    """Points of the cells an instructor grades by hand (a markdown answer, or a graded solution
    cell): autograding gives them nothing until `nbgrader formgrader` does."""
    manual = 0.0
    for notebook in submission.notebooks:
        solution_names = {cell.name for cell in notebook.notebook.solution_cells}
        for grade in notebook.grades:
            if grade.cell_type == "markdown" or grade.name in solution_names:
                manual += float(grade.max_score)
    return manual


def _zero(gradebook, lab: str, student: str, zeroed: Mapping[str, str]) -> None:
    """Give the test cells in ``zeroed`` 0 points in the gradebook (formgrader shows it), with why."""
    from nbgrader.api import MissingEntry

    for grade_id, why in zeroed.items():
        try:
            grade = gradebook.find_grade(grade_id, lab, lab, student)
        except MissingEntry:
            continue
        grade.manual_score = 0.0
        try:
            gradebook.find_comment(grade_id, lab, lab, student).manual_comment = f"0 points: {why} (minillm grading)"
        except MissingEntry:
            pass
    gradebook.db.commit()


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "[ERROR]" in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "no output"


def _reason(flags, zeroed, execute_report, guard_records, failures) -> str:
    parts = []
    for name in execute_report.get("deaths", []):
        parts.append(f"kernel died in cell {name}")
    for cell in execute_report.get("cells", []):
        if cell["status"] == "timed out":
            parts.append(f"cell {cell['name']} timed out")
    for record in guard_records:
        parts.append(f"the guard saw {', '.join(record['changes'][:3])} {record['when']} ({record['cell']})")
    parts.extend(flags)
    return "; ".join(dict.fromkeys(parts))


def _failed_row(student: str, lab: str, course: LabCourse, reason: str, seconds: float = 0.0, log: str = "") -> dict:
    return {"student": student, "lab": lab, "status": "failed", "reason": reason, "score": 0.0,
            "max_score": course.max_score, "manual_max_score": 0.0, "failures": {}, "errors": {}, "flags": [],
            "notes": [], "zeroed": {}, "seconds": seconds, "kernel_s": 0.0, "slowest_cell_s": 0.0, "log": log}


def _grade_one(course_root: Path, course: LabCourse, student: str, path: Path, env: dict, timeout_s: int,
               log_dir: Path) -> dict:
    lab = course.name
    log_path = log_dir / student / f"{lab}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not Path(path).is_file():
        log_path.write_text(f"no notebook at {path}\n", encoding="utf-8")
        return _failed_row(student, lab, course, f"no notebook at {path}", log=str(log_path))
    try:
        copy_ = graded_copy(read_submission(path), course)
    except (SubmissionError, OSError) as error:
        log_path.write_text(f"{path}: {error}\n", encoding="utf-8")
        return _failed_row(student, lab, course, str(error), log=str(log_path))
    target = course_root / "submitted" / student / lab / f"{lab}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(copy_.notebook, target)
    timestamp = Path(path).parent / "timestamp.txt"  # nbgrader's submission time (late penalties, feedback)
    if timestamp.is_file():
        shutil.copyfile(timestamp, target.parent / "timestamp.txt")
    reports = course_root / "reports" / student / lab
    reports.mkdir(parents=True, exist_ok=True)
    env = {**env, guard.REPORT_ENV: str(reports / "guard.jsonl"), EXECUTE_REPORT_ENV: str(reports / "execute.json")}
    command = [PYTHON, "-m", "nbgrader", "autograde", lab, "--student", student, "--force", "--create",
               f"--Execute.timeout={int(timeout_s)}"]
    # A notebook whose every cell loops still ends: each costs one timeout, plus setup.
    wall_limit = 300 + timeout_s * max(1, sum(1 for c in copy_.notebook.cells if c.cell_type == "code"))
    try:
        result = subprocess.run(command, cwd=course_root, env=env, capture_output=True, text=True, timeout=wall_limit)
        returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
    except subprocess.TimeoutExpired as error:
        returncode, stdout, stderr = None, error.stdout or "", (error.stderr or "") + f"\nkilled after {wall_limit} s"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    seconds = time.perf_counter() - start
    header = [f"# {student} / {lab}: {' '.join(command)}", *[f"# flag: {f}" for f in copy_.flags],
              *[f"# note: {n}" for n in copy_.notes]]
    log_path.write_text("\n".join(header) + f"\n{stdout}\n{stderr}", encoding="utf-8")
    autograded = course_root / "autograded" / student / lab / f"{lab}.ipynb"
    try:
        execute_report = json.loads((reports / "execute.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        execute_report = {}
    guard_records = guard.read_report(reports / "guard.jsonl")
    if returncode != 0 or not autograded.is_file():
        why = "grading took too long and was stopped" if returncode is None else _last_error_line(stderr + stdout)
        row = _failed_row(student, lab, course, f"nbgrader could not grade it: {why}", seconds, str(log_path))
        row["flags"] = copy_.flags
        return row
    zeroed = dict(copy_.zeroed)
    for record in guard_records:
        if record["when"] == "while a cell ran" and record["cell"] in course.preambles:
            zeroed.setdefault(record["cell"], f"the guard saw {', '.join(record['changes'][:3])} while it ran")
    from nbgrader.api import Gradebook

    with Gradebook("sqlite:///" + str(course_root / "gradebook.db"), COURSE_ID) as gradebook:
        if zeroed:
            _zero(gradebook, lab, student, zeroed)
        submission = gradebook.find_submission(lab, student)
        score, max_score, manual = float(submission.score), float(submission.max_score), _manual_max_score(submission)
    failures, errors = _errors(autograded)
    for grade_id, why in zeroed.items():
        failures.setdefault(grade_id, f"0 points: {why}")
    cells = execute_report.get("cells", [])
    return {
        "student": student, "lab": lab, "status": "graded",
        "reason": _reason(copy_.flags, zeroed, execute_report, guard_records, failures),
        "score": score, "max_score": max_score, "manual_max_score": manual,
        "failures": failures, "errors": errors, "flags": copy_.flags, "notes": copy_.notes, "zeroed": zeroed,
        "seconds": seconds, "kernel_s": sum(c["seconds"] for c in cells),
        "slowest_cell_s": max((c["seconds"] for c in cells), default=0.0), "log": str(log_path),
    }


def _check_request(submissions: Mapping[str, Mapping[str, Path]], known_labs: list[str]) -> list[str]:
    labs = sorted({lab for by_lab in submissions.values() for lab in by_lab})
    unknown = [lab for lab in labs if lab not in known_labs]
    if unknown:
        raise ValueError(f"no master for lab(s) {unknown}; labs with a master: {known_labs}")
    for student in submissions:
        if not STUDENT_ID.fullmatch(student):
            raise ValueError(f"student id {student!r} must match {STUDENT_ID.pattern} (it becomes a folder name)")
    return labs


def find_submissions(submissions_dir: Path) -> dict[str, dict[str, Path]]:
    """``SUBMISSIONS_DIR/<student_id>/<NN_topic>/<NN_topic>.ipynb`` as ``{student: {lab: path}}``
    (also nbgrader's own submitted/ folder). A lab folder without the notebook is listed too, with
    the missing path, so that student gets a row saying so."""
    submissions_dir = Path(submissions_dir)
    if not submissions_dir.is_dir():
        raise FileNotFoundError(f"no submissions folder at {submissions_dir}")
    found: dict[str, dict[str, Path]] = {}
    for lab_dir in sorted(submissions_dir.glob("*/*")):
        if not lab_dir.is_dir() or lab_dir.name.startswith(".") or lab_dir.parent.name.startswith("."):
            continue
        found.setdefault(lab_dir.parent.name, {})[lab_dir.name] = lab_dir / f"{lab_dir.name}.ipynb"
    return found


def autograde(
    submissions: Mapping[str, Mapping[str, Path | str]],
    *,
    source_dir: Path = SOURCE_DIR,
    course_dir: Path | None = None,
    quick: bool = True,
    cell_timeout_s: int | None = None,
    feedback_dir: Path | None = None,
    log_dir: Path | None = None,
    progress: bool = False,
) -> list[dict]:
    """Autograde ``{student: {lab: notebook_path}}``; return one row per (student, lab), sorted
    by student then lab, whatever the notebooks do:

    ``status`` ("graded", or "failed" when the file cannot be graded: missing, not JSON, not a
    notebook, nbgrader itself failed), ``reason`` (why a row failed, and for a graded one what
    happened: kernel deaths, timeouts, screened or changed cells, guard findings; "" when clean),
    ``score``, ``max_score``, ``manual_max_score`` (the part of ``max_score`` graded by hand, not in
    ``score`` yet), ``failures`` (graded test cells that earned nothing: ``"ErrorName: message"``),
    ``errors`` (every code cell that raised), ``flags``, ``zeroed``, ``seconds`` (wall time of this
    notebook's grading), ``kernel_s`` and ``slowest_cell_s`` (its cells), ``log`` (nbgrader's log).

    ``course_dir``: build the nbgrader course there and keep it (graded copies, autograded
    notebooks, gradebook) instead of in a temporary folder. ``quick``: MINILLM_QUICK=1.
    ``cell_timeout_s``: per-cell limit (default: measured per lab, grading/quick_times.json).
    ``feedback_dir``: write ``<student>/<lab>/<lab>.html`` feedback there (no hidden test text).
    ``log_dir``: keep each notebook's log there as ``<student>/<lab>.log``.
    """
    submissions = {student: {lab: Path(p) for lab, p in by_lab.items()} for student, by_lab in submissions.items()}
    labs = _check_request(submissions, discover_labs(source_dir))
    if not labs:
        return []
    times = quick_times()
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as tmp:
        course_root = Path(course_dir) if course_dir is not None else Path(tmp) / "course"
        if course_root.exists() and any(course_root.iterdir()):
            raise FileExistsError(f"course folder {course_root} is not empty; give a new folder")
        courses = prepare_course(course_root, labs, source_dir)
        logs = Path(log_dir) if log_dir is not None else course_root / "logs"
        env = _kernel_env(quick)
        jobs = [(student, lab) for student in sorted(submissions) for lab in sorted(submissions[student])]
        iterator = jobs
        if progress:
            from tqdm.auto import tqdm

            iterator = tqdm(jobs, desc="autograde", unit="notebook")
        rows = []
        for student, lab in iterator:
            timeout_s = cell_timeout_s if cell_timeout_s is not None else (cell_timeout_for(lab, times) if quick else DEFAULT_CELL_TIMEOUT_S)
            path = submissions[student][lab]
            rows.append(_grade_one(course_root, courses[lab], student, path, env, timeout_s, logs))
            rows[-1]["submitted_dir"] = str(path.parent)
        if feedback_dir is not None:
            from grading import feedback

            for row in rows:
                feedback.write(row, course_root, courses[row["lab"]], Path(feedback_dir))
        return rows


# --- output ----------------------------------------------------------------------------------------

CSV_FIELDS = ["student", "lab", "status", "score", "max_score", "manual_max_score", "seconds", "reason"]


def write_csv(rows: list[dict], path: Path) -> None:
    """One line per (student, lab): student, lab, status, score, max_score, manual_max_score, seconds, reason."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "seconds": f"{row.get('seconds', 0.0):.1f}"})


def format_table(rows: list[dict], times: Mapping[str, dict] | None = None) -> str:
    """A plain-text table: score, the failing graded cells, the time against the lab's measured
    quick-mode run, and the reason."""
    times = quick_times() if times is None else times
    header = ("student", "lab", "score", "time", "failed cells", "reason")
    lines = []
    for row in rows:
        score = f"{row['score']:g} / {row['max_score']:g}" + (
            f" ({row['manual_max_score']:g} by hand)" if row.get("manual_max_score") else "")
        if row["status"] == "failed":
            score = "FAILED"
        reference = times.get(row["lab"], {}).get("quick_s")
        took = f"{row.get('seconds', 0.0):.0f} s" + (f" (solution {reference:.0f} s)" if reference else "")
        lines.append((row["student"], row["lab"], score, took, ", ".join(sorted(row["failures"])) or "-",
                      row.get("reason") or "-"))
    widths = [max(len(str(item)) for item in column) for column in zip(header, *lines)]
    return "\n".join("  ".join(str(item).ljust(width) for item, width in zip(line, widths)).rstrip() for line in [header, *lines])


def measure_quick_times(labs: list[str] | None = None, source_dir: Path = SOURCE_DIR,
                        solutions_dir: Path | None = None) -> dict[str, dict]:
    """Grade each lab's committed solution in quick mode and record its time and slowest cell."""
    import platform

    labs = discover_labs(source_dir) if labs is None else labs
    solutions_dir = REPO_ROOT / "solutions" if solutions_dir is None else Path(solutions_dir)
    rows = autograde({"solution": {lab: solutions_dir / f"{lab}.ipynb" for lab in labs}}, source_dir=source_dir,
                     cell_timeout_s=DEFAULT_CELL_TIMEOUT_S, progress=True)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    measured = {}
    for row in rows:
        if row["status"] != "graded" or row["failures"]:
            raise RuntimeError(f"the solution of {row['lab']} did not grade clean: {row['reason'] or row['failures']}")
        measured[row["lab"]] = {"quick_s": round(row["seconds"], 1), "cells_s": round(row["kernel_s"], 1),
                                "slowest_cell_s": round(row["slowest_cell_s"], 1), "measured_on": machine}
    return measured
