"""Autograde lab submissions: each in a sandbox, every verdict decided outside it; one row per (student, lab).

The course is rebuilt from the instructor masters (grading/source) each time, so the tests and the
hidden tests come from the masters, never from what a student hands in. From a submission only the
**solution cells** are taken (matched by nbgrader ``grade_id``); every other cell comes from the
master, and the student's own extra cells are not run.

Each notebook then runs in two processes in step (grading.execute): the grader's kernel runs the
master's cells and every test, and the student's solution cells run in a sandbox (grading.sandbox:
no view of the course, the gradebook or the repository, no network, limited, killed whole), where
the references the lab's exercises rebuild are stubbed out (grading.references). The tests reach the
learner's functions over a data-only channel (grading.remote, grading.wire) and compare the data in
the grader's kernel, where no student code has run. Notebooks run ``jobs`` at a time.

When every sandbox is gone, ``nbgrader autograde`` writes the gradebook from the recorded outputs,
and the rows, the CSV and the feedback come from it: scores from the autograded cells only (a manual
score that did not come from the formgrader is ignored and named in the row). A test cell the student
deleted or changed scores 0; the row's ``reason`` says what was refused, flagged, timed out or died.

    rows = autograde({"ada": {"01_prefill_decode": "ada/01_prefill_decode.ipynb"}})
    # [{"student": "ada", "lab": "01_prefill_decode", "status": "graded", "score": 6.0,
    #   "max_score": 6.0, "reason": "", "failures": {}, ...}]
"""

from __future__ import annotations

import ast
import concurrent.futures
import copy
import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from grading import references, sandbox
from grading.build import (COURSE_ID, GRADING_DIR, HIDDEN_BEGIN, HIDDEN_END, REPO_ROOT, SOURCE_DIR,  # noqa: F401
                           discover_labs, dumps, find_submissions, generate_assignments, hidden_line_numbers, make_course,
                           read_master, without_model_answers)
from grading.execute import EXECUTED_ENV, START_SOURCE

STUDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*")
# The interpreter that runs nbgrader also runs the kernel ("python3" kernelspec -> sys.executable).
PYTHON = sys.executable

SANDBOX_CELL_ID = "minillm_grading_sandbox"
STUB = "raise NotImplementedError(\"minillm grading: this solution cell was not run (the grade's reason says why)\")"

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
    """The top-level imports of the master's code cells (its solution cells' too: a test may use a module
    only the solution imports), to run again at the top of each test cell (a name the tests use is then
    the module again, whatever a cell bound to it)."""
    lines: list[str] = []
    for cell in master.cells:
        if cell.cell_type != "code":
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
    """The lines the graded copy puts at the top of test cell ``grade_id``: the learner's names
    fetched afresh from the sandbox, then the master's imports again (a name the tests use is the
    module, whatever a cell bound to it)."""
    return "\n".join([f"import grading.remote as _minillm_sandbox; _minillm_sandbox.refresh(globals(), {grade_id!r})",
                      *imports]) + "\n"


def grading_master(master) -> nbformat.NotebookNode:
    """The master as the grading course holds it: the sandbox's start first, the preamble on every test."""
    nb = copy.deepcopy(master)
    imports = _import_lines(master)
    for cell in nb.cells:
        if _is_test(cell):
            cell.source = preamble(_nbgrader(cell)["grade_id"], imports) + cell.source
    start_cell = nbformat.v4.new_code_cell(
        START_SOURCE,
        id=SANDBOX_CELL_ID,
        metadata={"nbgrader": {"grade": False, "solution": False, "locked": True, "grade_id": SANDBOX_CELL_ID,
                               "schema_version": 3}},
    )
    nb.cells.insert(0, start_cell)
    return nb


RUNS_IN = ("both", "sandbox", "grader")


def bound_names(source: str) -> set[str]:
    """Every name a cell binds at its top level (definitions, assignments, imports, loop and with targets)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    bound: set[str] = set()

    def targets(node):
        if isinstance(node, ast.Name):
            bound.add(node.id)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                targets(element)
        elif isinstance(node, ast.Starred):
            targets(node.value)

    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names if alias.name != "*")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                targets(target)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For)):
            targets(node.target)
        elif isinstance(node, ast.With):
            for item in node.items:
                if item.optional_vars is not None:
                    targets(item.optional_vars)
        elif isinstance(node, ast.Try):
            for inner in node.body + node.orelse + node.finalbody:
                for name in bound_names(ast.unparse(inner)):
                    bound.add(name)
    return bound


def import_names(source: str) -> set[str]:
    """The names a cell binds by import at its top level."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {(alias.asname or alias.name).split(".")[0] for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names if alias.name != "*"}


def import_statements(source: str) -> list[str]:
    """A cell's top-level import statements, one line each."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def runs_in(cell) -> str:
    """Where a locked code cell runs: "both" (default), "sandbox" or "grader" (metadata minillm.runs_in)."""
    where = cell.get("metadata", {}).get("minillm", {}).get("runs_in", "both")
    if where not in RUNS_IN:
        raise ValueError(f"cell {cell.get('id')}: minillm.runs_in={where!r}; one of {RUNS_IN}")
    return where


def plan(grading_nb, master) -> dict[str, dict]:
    """``{cell index: {"kind", "names"}}`` for the graded copy (the grading master, start cell first, whose
    cells nbgrader's release keeps in order):
    "start", "learner" (a solution cell; ``names``: what the master's version binds), "both" / "sandbox"
    (``names``: what it binds, taken as data) / "grader" (locked cells), "test"."""
    master_solutions = {_nbgrader(c).get("grade_id"): c for c in master.cells if _nbgrader(c).get("solution")}
    # The names of the cells run in both places (llm, torch, lab02, ...) stay the grader's: a solution cell
    # that rebinds one changes the sandbox only. Imported modules are never data.
    locked = set().union(*(bound_names(c.source) for c in master.cells
                           if c.cell_type == "code" and not _nbgrader(c).get("solution") and runs_in(c) == "both"))
    kernel_exercises = master.metadata.get("minillm", {}).get("kernels", {})
    steps = {}
    for index, cell in enumerate(grading_nb.cells):
        if cell.cell_type != "code":
            continue
        meta = _nbgrader(cell)
        if meta.get("grade_id") == SANDBOX_CELL_ID:
            steps[str(index)] = {"kind": "start", "names": []}
        elif meta.get("solution"):
            solved = master_solutions.get(meta.get("grade_id"))
            source = solved.source if solved else ""
            steps[str(index)] = {"kind": "learner", "names": sorted(bound_names(source) - locked - import_names(source)),
                                 "imports": import_statements(source),
                                 "kernels": list(kernel_exercises.get(meta.get("grade_id"), []))}
        elif _is_test(cell):
            steps[str(index)] = {"kind": "test", "names": []}
        else:
            where = runs_in(cell)
            names = bound_names(cell.source) - import_names(cell.source) if where in ("sandbox", "grader") else set()
            steps[str(index)] = {"kind": where, "names": sorted(names)}
            if where == "sandbox":
                steps[str(index)]["imports"] = import_statements(cell.source)
    return steps


@dataclass
class LabCourse:
    """What grading one lab needs from the grading course."""

    name: str
    release: nbformat.NotebookNode          # the grading release: start cell, preambles, no hidden tests
    sources: dict[str, tuple[str, str]]     # grade_id -> (gradebook source with hidden tests, checksum)
    preambles: dict[str, str]               # test grade_id -> its preamble
    max_score: float = 0.0
    plan: dict[str, dict] = field(default_factory=dict)
    references: dict[str, list[str]] = field(default_factory=dict)
    library: references.SandboxLibrary | None = None

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


def prepare_course(course_root: Path, labs: list[str], source_dir: Path = SOURCE_DIR,
                   library_dir: Path | None = None) -> dict[str, LabCourse]:
    """A throwaway nbgrader course at ``course_root`` whose masters carry the sandbox's start and the
    tests' preambles; assignments generated (gradebook: graded cells, hidden tests). With
    ``library_dir``, each lab's sandbox library (grading.references) is prepared there too."""
    from nbgrader.api import Gradebook

    make_course(course_root, labs, source_dir)
    masters, grading_masters = {}, {}
    for lab in labs:
        masters[lab] = read_master(lab, source_dir)
        graded = grading_masters[lab] = grading_master(without_model_answers(masters[lab]))
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
            declared = references.declared(masters[lab])
            library = (references.prepare(lab, declared, Path(library_dir) / lab, master=masters[lab])
                       if library_dir is not None else None)
            if [c.get("id") for c in release.cells] != [c.get("id") for c in grading_masters[lab].cells]:
                raise RuntimeError(f"nbgrader's release of {lab} does not keep the master's cells in order")
            courses[lab] = LabCourse(lab, release, sources, preambles, float(gradebook.find_assignment(lab).max_score),
                                     plan(grading_masters[lab], masters[lab]), declared, library)
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
    flags: list[str]          # integrity findings: changed or deleted locked cells, missing solution cells
    zeroed: dict[str, str]    # test grade_id -> why it scores 0 whatever it does
    notes: list[str]          # informational: extra cells not run


def graded_copy(submission: nbformat.NotebookNode, lab: LabCourse) -> GradedCopy:
    """The notebook nbgrader runs: the grading release with the student's solution cells put in
    (to run in the sandbox), the tests with their hidden parts and the checksums the gradebook holds."""
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
            cell.source = source
            continue
        if grade_id and grade_id in lab.sources:
            if grade_id != SANDBOX_CELL_ID and cell.cell_type == "code":  # locked markdown only explains
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
    # grading.remote) run in the throwaway course folder: the grader's package is found from here.
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


def _sandbox_events(path: Path) -> list[dict]:
    """The graded kernel's record of its sandbox (grading.remote): restarts, timeouts, deaths, refusals."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _reason(flags: list[str], execute_report: dict, events: list[dict], extra: list[str]) -> str:
    parts = []
    for name in execute_report.get("deaths", []):
        parts.append(f"the grader's kernel died in cell {name}")
    for cell in execute_report.get("cells", []):
        if cell["status"] == "timed out":
            parts.append(f"cell {cell['name']} timed out")
    for event in events:
        kind, cell = event.get("event"), event.get("cell")
        if kind == "timeout":
            parts.append(f"cell {cell} timed out in the sandbox")
        elif kind == "died":
            parts.append(f"the sandbox died in cell {cell}")
        elif kind == "refused":
            parts.append(f"refused in {cell}: {event.get('what')}")
        elif kind == "reference":
            parts.append(f"refused in {cell}: the reference {event.get('what')} (unavailable in the sandbox)")
    parts.extend(flags)
    parts.extend(extra)
    return "; ".join(dict.fromkeys(parts))


def _failed_row(student: str, lab: str, course: LabCourse, reason: str, seconds: float = 0.0, log: str = "") -> dict:
    return {"student": student, "lab": lab, "status": "failed", "reason": reason, "score": 0.0,
            "max_score": course.max_score, "manual_max_score": 0.0, "failures": {}, "errors": {}, "flags": [],
            "notes": [], "zeroed": {}, "seconds": seconds, "kernel_s": 0.0, "slowest_cell_s": 0.0, "log": log}


@dataclass
class _Job:
    """One notebook to run: its graded copy and where its files go."""

    student: str
    lab: str
    path: Path                   # the submission
    graded: Path                 # the graded copy (submitted/ of the course)
    executed: Path               # executed/<lab>/<student>/<lab>.ipynb
    folder: Path                 # reports/<student>/<lab>/: plan, spec, reports, the sandbox's log
    log: Path
    copy: "GradedCopy"
    seconds: float = 0.0
    returncode: int | None = None
    output: str = ""


def _threads_per_job(jobs: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        cores = min(cores, int(os.environ["OMP_NUM_THREADS"])) if jobs == 1 else cores
    return max(1, cores // max(1, jobs))


def _sandbox_spec(job: _Job, course: LabCourse, scratch: Path, quick: bool, timeout_s: int, threads: int,
                  unsafe: bool, limits: sandbox.Limits, run_id: str) -> dict:
    from minillm.config import cache_root

    library = course.library
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "MINILLM_QUICK": "1" if quick else "",
           "MINILLM_GRADING_RUN": run_id}
    for name in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return {
        "scratch": str(scratch), "runner_dir": str(library.runner_dir), "package_binds": library.package_binds,
        "bans": library.bans, "env": env, "limits": vars(limits), "cache_root": str(cache_root()),
        "log": str(job.folder / "sandbox.log"), "report": str(job.folder / "sandbox.jsonl"),
        "cell_timeout_s": timeout_s, "call_timeout_s": timeout_s, "unsafe": unsafe, "python": PYTHON,
        "run_id": run_id,
    }


def _run_job(job: _Job, env: dict, timeout_s: int, progress) -> _Job:
    """Run one graded copy in its own process (grading.execute): the grader's kernel and its sandbox."""
    kernel_timeout = 3 * timeout_s + 60  # a test may call the learner's code many times, each within timeout_s
    code_cells = sum(1 for c in job.copy.notebook.cells if c.cell_type == "code")
    wall_limit = 300 + kernel_timeout * max(1, code_cells)
    command = [PYTHON, "-m", "grading.execute", str(job.graded), str(job.executed), "--plan", str(job.folder / "plan.json"),
               "--report", str(job.folder / "execute.json"), "--timeout", str(kernel_timeout), "--cwd", str(job.folder / "kernel")]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=wall_limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output = (output or "") + f"\nkilled after {wall_limit} s"
    job.seconds, job.returncode, job.output = time.perf_counter() - start, process.returncode, output or ""
    if progress is not None:
        progress(job)
    return job


def _sweep_sandboxes(run_id: str) -> list[int]:
    """Kill every process of every sandbox this run started, and remove their cgroups: nothing a
    submission started outlives its grading. Returns the pids that had to be killed."""
    killed = []
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        if not root.is_dir():
            continue
        for path in root.rglob(f"minillm-grading-{run_id}-*") if root.name == "cgroup" else root.glob(f"minillm-grading-{run_id}-*"):
            group = sandbox.Cgroup([path], 2 if root.name == "cgroup" else 1)
            killed += group.pids()
            group.kill()
    return killed


def _nbgrader_autograde(course_root: Path, lab: str, env: dict, log_path: Path) -> None:
    """nbgrader autograde for every student of ``lab``, the outputs replayed from the runs (no kernel)."""
    command = [PYTHON, "-m", "nbgrader", "autograde", lab, "--force", "--create"]  # ReplayOutputs: nbgrader_config.py
    env = {**env, EXECUTED_ENV: str(course_root / "executed" / lab)}
    done = subprocess.run(command, cwd=course_root, env=env, capture_output=True, text=True, timeout=3600)
    log_path.write_text(f"# {' '.join(command)}\n{done.stdout}\n{done.stderr}", encoding="utf-8")


def _scores(gradebook, lab: str, student: str, zeroed: Mapping[str, str]) -> tuple[float, float, float, list[str]]:
    """(score, max_score, manual_max_score, notes) from the gradebook's autograded cells only: a manual score
    on an autograded cell cannot have come from the formgrader yet (the course is new), so it is removed
    and named."""
    submission = gradebook.find_submission(lab, student)
    score, manual_max, notes = 0.0, 0.0, []
    for notebook in submission.notebooks:
        solution_names = {cell.name for cell in notebook.notebook.solution_cells}
        for grade in notebook.grades:
            if grade.cell_type == "markdown" or grade.name in solution_names:
                manual_max += float(grade.max_score)
                if grade.manual_score is not None:
                    notes.append(f"ignored a manual score on {grade.name} that did not come from the formgrader")
                    grade.manual_score = None
                continue
            if grade.manual_score is not None and grade.name not in zeroed:
                notes.append(f"ignored a manual score on {grade.name} that did not come from the formgrader")
                grade.manual_score = None
            if grade.name not in zeroed:
                score += float(grade.auto_score or 0.0)
    gradebook.db.commit()
    return score, float(submission.max_score), manual_max, notes


def _student_section(log: str, student: str) -> str:
    """The lines of one lab's ``nbgrader autograde`` log about one student (it grades them in turn)."""
    lines, keep = [], False
    for line in log.splitlines():
        if "Creating/updating student with ID" in line:
            keep = f"'{student}'" in line
        if keep:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _row(job: _Job, course: LabCourse, course_root: Path) -> dict:
    lab, student = job.lab, job.student
    header = [f"# {student} / {lab}: graded in {job.seconds:.1f} s", *[f"# flag: {f}" for f in job.copy.flags],
              *[f"# note: {n}" for n in job.copy.notes]]
    sandbox_log = job.folder / "sandbox.log"
    sandbox_text = sandbox_log.read_text(encoding="utf-8", errors="replace")[-200_000:] if sandbox_log.is_file() else ""
    nbgrader_log = course_root / "logs" / f"{lab}.nbgrader.log"
    nbgrader_text = _student_section(nbgrader_log.read_text(encoding="utf-8"), student) if nbgrader_log.is_file() else ""
    job.log.parent.mkdir(parents=True, exist_ok=True)
    job.log.write_text("\n".join(header) + f"\n{job.output}\n# the sandbox's own output:\n{sandbox_text}\n"
                       f"# nbgrader autograde:\n{nbgrader_text}", encoding="utf-8")
    try:
        execute_report = json.loads((job.folder / "execute.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        execute_report = {}
    events = _sandbox_events(job.folder / "sandbox.jsonl")
    autograded = course_root / "autograded" / student / lab / f"{lab}.ipynb"
    if job.returncode != 0 or not autograded.is_file():
        why = _last_error_line(job.output) if job.returncode != 0 else "nbgrader autograde wrote no notebook"
        row = _failed_row(student, lab, course, f"could not be graded: {why}", job.seconds, str(job.log))
        row["flags"] = job.copy.flags
        return row
    zeroed = dict(job.copy.zeroed)
    from nbgrader.api import Gradebook

    with Gradebook("sqlite:///" + str(course_root / "gradebook.db"), COURSE_ID) as gradebook:
        if zeroed:
            _zero(gradebook, lab, student, zeroed)
        score, max_score, manual, notes = _scores(gradebook, lab, student, zeroed)
    failures, errors = _errors(autograded)
    for grade_id, why in zeroed.items():
        failures.setdefault(grade_id, f"0 points: {why}")
    cells = execute_report.get("cells", [])
    return {
        "student": student, "lab": lab, "status": "graded",
        "reason": _reason(job.copy.flags, execute_report, events, notes),
        "score": score, "max_score": max_score, "manual_max_score": manual,
        "failures": failures, "errors": errors, "flags": job.copy.flags, "notes": job.copy.notes, "zeroed": zeroed,
        "events": events, "seconds": job.seconds, "kernel_s": sum(c["seconds"] for c in cells),
        "slowest_cell_s": max((c["seconds"] for c in cells), default=0.0), "log": str(job.log),
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
    jobs: int = 1,
    unsafe_no_sandbox: bool = False,
    similarity: bool = False,
    limits: sandbox.Limits | None = None,
) -> list[dict]:
    """Autograde ``{student: {lab: notebook_path}}``; return one row per (student, lab), sorted
    by student then lab, whatever the notebooks do:

    ``status`` ("graded", or "failed" when the file cannot be graded: missing, not JSON, not a
    notebook, its run failed), ``reason`` (why a row failed, and for a graded one what happened:
    timeouts and deaths, values refused, references reached, changed or deleted cells, ignored
    manual scores, similarity flags; "" when clean), ``score``, ``max_score``, ``manual_max_score``
    (the part of ``max_score`` graded by hand, not in ``score`` yet), ``failures`` (graded test cells
    that earned nothing: ``"ErrorName: message"``), ``errors`` (every code cell that raised), ``flags``,
    ``zeroed``, ``seconds`` (wall time of this notebook's run), ``kernel_s`` and ``slowest_cell_s``
    (its cells), ``log``.

    ``course_dir``: build the nbgrader course there and keep it (graded copies, executed and
    autograded notebooks, gradebook) instead of in a temporary folder. ``quick``: MINILLM_QUICK=1.
    ``cell_timeout_s``: per-cell limit (default: measured per lab, grading/quick_times.json).
    ``feedback_dir``: write ``<student>/<lab>/<lab>.html`` feedback there (no hidden test text).
    ``log_dir``: keep each notebook's log there as ``<student>/<lab>.log``. ``jobs``: notebooks run
    at once, each with its share of the cores. ``unsafe_no_sandbox``: run the submissions without the
    sandbox (SandboxUnavailable otherwise, where none can be made). ``similarity``: flag solution cells
    close to the lab's references or to another student's (grading.similarity). ``limits``: the
    sandbox's CPU, memory, file and process limits (default: grading.sandbox.default_limits).
    """
    submissions = {student: {lab: Path(p) for lab, p in by_lab.items()} for student, by_lab in submissions.items()}
    labs = _check_request(submissions, discover_labs(source_dir))
    if not labs:
        return []
    if not unsafe_no_sandbox:
        sandbox.require()
    jobs = max(1, int(jobs))
    limits = limits or sandbox.default_limits(jobs)
    times = quick_times()
    run_id = uuid.uuid4().hex[:12]
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as tmp:
        course_root = Path(course_dir) if course_dir is not None else Path(tmp) / "course"
        if course_root.exists() and any(course_root.iterdir()):
            raise FileExistsError(f"course folder {course_root} is not empty; give a new folder")
        # Outside the course folder: what the sandboxes see (their libraries, their scratch folders).
        outside = Path(tmp) / "sandboxes"
        courses = prepare_course(course_root, labs, source_dir, library_dir=outside / "libraries")
        logs = Path(log_dir) if log_dir is not None else course_root / "logs"
        (course_root / "logs").mkdir(parents=True, exist_ok=True)
        env = _kernel_env(quick)
        threads = _threads_per_job(jobs)
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "MINILLM_GRADING_RUN": run_id})
        rows: dict[tuple[str, str], dict] = {}
        pending: list[_Job] = []
        for student in sorted(submissions):
            for lab in sorted(submissions[student]):
                path, course = submissions[student][lab], courses[lab]
                log = logs / student / f"{lab}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                if not path.is_file():
                    log.write_text(f"no notebook at {path}\n", encoding="utf-8")
                    rows[(student, lab)] = _failed_row(student, lab, course, f"no notebook at {path}", log=str(log))
                    continue
                try:
                    submission = read_submission(path)
                    graded = graded_copy(submission, course)
                except (SubmissionError, OSError) as error:
                    log.write_text(f"{path}: {error}\n", encoding="utf-8")
                    rows[(student, lab)] = _failed_row(student, lab, course, str(error), log=str(log))
                    continue
                target = course_root / "submitted" / student / lab / f"{lab}.ipynb"
                target.parent.mkdir(parents=True, exist_ok=True)
                nbformat.write(graded.notebook, target)
                timestamp = path.parent / "timestamp.txt"  # nbgrader's submission time (late penalties, feedback)
                if timestamp.is_file():
                    shutil.copyfile(timestamp, target.parent / "timestamp.txt")
                folder = course_root / "reports" / student / lab
                (folder / "kernel").mkdir(parents=True, exist_ok=True)
                scratch = outside / "scratch" / f"{student}-{lab}"
                scratch.mkdir(parents=True, exist_ok=True)
                nbformat.write(submission, scratch / f"{lab}.ipynb")  # the sandbox's copy of its notebook
                executed = course_root / "executed" / lab / student / f"{lab}.ipynb"
                executed.parent.mkdir(parents=True, exist_ok=True)
                job = _Job(student, lab, path, target, executed, folder, log, graded)
                timeout_s = cell_timeout_s if cell_timeout_s is not None else (
                    cell_timeout_for(lab, times) if quick else DEFAULT_CELL_TIMEOUT_S)
                (folder / "plan.json").write_text(json.dumps(course.plan), encoding="utf-8")
                spec = _sandbox_spec(job, course, scratch, quick, timeout_s, threads, unsafe_no_sandbox, limits, run_id)
                (folder / "sandbox.json").write_text(json.dumps(spec), encoding="utf-8")
                pending.append(job)
        progress_bar = None
        lock = threading.Lock()
        if progress and pending:
            from tqdm.auto import tqdm

            progress_bar = tqdm(total=len(pending), desc="autograde", unit="notebook")

        def report(job: _Job) -> None:
            with lock:
                if progress_bar is not None:
                    progress_bar.update(1)
                    progress_bar.write(f"{job.student} / {job.lab}: ran in {job.seconds:.0f} s")

        def run(job: _Job) -> _Job:
            timeout_s = json.loads((job.folder / "sandbox.json").read_text(encoding="utf-8"))["cell_timeout_s"]
            job_env = {**env, "MINILLM_SANDBOX_SPEC_PATH": str(job.folder / "sandbox.json")}
            return _run_job(job, job_env, int(timeout_s), report)

        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(run, pending))
        finally:
            if progress_bar is not None:
                progress_bar.close()
            # Every sandbox is gone before anything is scored: whatever a submission started (a detached
            # process of its own) is killed with its cgroup here.
            killed = _sweep_sandboxes(run_id)
        for job in pending:
            if killed:
                job.copy.notes.append(f"{len(killed)} leftover sandbox processes of this run were killed")
        for lab in labs:
            if any(job.lab == lab for job in pending):
                _nbgrader_autograde(course_root, lab, env, course_root / "logs" / f"{lab}.nbgrader.log")
        for job in pending:
            rows[(job.student, job.lab)] = _row(job, courses[job.lab], course_root)
        ordered = [rows[key] for key in sorted(rows)]
        for row in ordered:
            row["submitted_dir"] = str(submissions[row["student"]][row["lab"]].parent)
        if similarity:
            from grading import similarity as similarity_mod

            similarity_mod.flag_rows(ordered, {lab: courses[lab] for lab in labs}, course_root)
        if feedback_dir is not None:
            from grading import feedback

            for row in ordered:
                feedback.write(row, course_root, courses[row["lab"]], Path(feedback_dir))
        return ordered


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
