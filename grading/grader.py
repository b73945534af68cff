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
import dataclasses
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
                           read_master, render, without_model_answers)
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


def _kind(value) -> str:
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _quote(text: str, limit: int = 40) -> str:
    """A student's string (a grade_id) as the grader names it: printable, at most ``limit`` characters."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return repr(clean if len(clean) <= limit else clean[:limit] + "...")


def _check_cell(number: int, cell) -> dict | None:
    """A cell's nbgrader metadata, after checking its shape; SubmissionError names what is malformed."""
    where = f"cell {number}"
    if not isinstance(cell, dict):
        raise SubmissionError(f"{where}: is {_kind(cell)}, expected a cell (a JSON object)")
    if cell.get("cell_type") not in ("code", "markdown", "raw"):
        raise SubmissionError(f"{where}: cell_type is {_kind(cell.get('cell_type'))}, expected code, markdown or raw")
    source = cell.get("source", "")
    if not (isinstance(source, str) or isinstance(source, list) and all(isinstance(s, str) for s in source)):
        raise SubmissionError(f"{where}: source is {_kind(source)}, expected a string or a list of strings")
    metadata = cell.get("metadata", {})
    if not isinstance(metadata, dict):
        raise SubmissionError(f"{where}: metadata is {_kind(metadata)}, expected an object")
    meta = metadata.get("nbgrader")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise SubmissionError(f"{where}: nbgrader metadata is {_kind(meta)}, expected an object")
    if "grade_id" in meta and not isinstance(meta["grade_id"], str):
        raise SubmissionError(f"{where}: grade_id is {_kind(meta['grade_id'])}, expected a string")
    for key in ("grade", "solution", "locked"):
        if key in meta and not isinstance(meta[key], bool):
            raise SubmissionError(f"{where}: nbgrader {key} is {_kind(meta[key])}, expected true or false")
    points = meta.get("points", 0)
    if isinstance(points, bool) or not isinstance(points, (int, float)) or not math.isfinite(points):
        raise SubmissionError(f"{where}: nbgrader points is {_kind(points)}, expected a number")
    return meta


GRADED_KEYS = ("grade", "solution", "locked")


def check_cells(submission, lab: LabCourse) -> list[str]:
    """The submission's cells against the lab's: SubmissionError for malformed cells (the row is an error),
    and a finding in words for each unknown, duplicated, retyped, re-flagged or reordered graded cell (the
    lab's cells and metadata are used; deleted, missing and changed cells are named by :func:`graded_copy`).
    Cells are numbered from 1, in the submission's order."""
    cells = submission.get("cells") if isinstance(submission, dict) else None
    if not isinstance(cells, list):
        raise SubmissionError("not a Jupyter notebook: no list of cells")
    ours = {}
    for cell in lab.release.cells:
        meta = _nbgrader(cell)
        if meta.get("grade_id") and meta.get("grade_id") != SANDBOX_CELL_ID:
            ours[meta["grade_id"]] = (cell.cell_type, meta)
    findings, seen, order = [], {}, []
    for number, cell in enumerate(cells, start=1):
        meta = _check_cell(number, cell)
        grade_id = (meta or {}).get("grade_id")
        if not grade_id:
            continue
        if grade_id not in ours:
            findings.append(f"cell {number}: grade_id {_quote(grade_id)} is not a cell of this lab (not run)")
            continue
        if grade_id in seen:
            findings.append(f"cell {number}: {grade_id} appears again (cell {seen[grade_id]} is the one graded)")
            continue
        seen[grade_id] = number
        order.append(grade_id)
        cell_type, expected = ours[grade_id]
        if cell.get("cell_type") != cell_type:
            findings.append(f"cell {number}: {grade_id} is a {cell.get('cell_type')} cell, the lab's is {cell_type}")
        elif (any(bool(meta.get(k)) != bool(expected.get(k)) for k in GRADED_KEYS)
              or float(meta.get("points", 0) or 0) != float(expected.get("points", 0) or 0)):
            findings.append(f"cell {number}: the nbgrader metadata of {grade_id} was edited (the lab's is used)")
    lab_order = [grade_id for grade_id in ours if grade_id in seen]
    if order != lab_order:
        first = next(i for i, (a, b) in enumerate(zip(order, lab_order)) if a != b)
        findings.append(f"graded cells reordered: {order[first]} comes before {lab_order[first]} "
                        "(the lab's order is used)")
    return findings


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


EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Died|Timeout))\b")
LOG_TAIL_BYTES = 200_000      # of each sandbox log, into the notebook's log
PREFLIGHT = "minillm-preflight-"  # the preflight's two students per lab (no real student id may start so)


def _exception_name(text: str) -> str:
    """The last exception class named at the start of a line of the grader's output (never its message,
    which may quote a cell's source)."""
    for line in reversed(text.splitlines()):
        match = EXCEPTION_LINE.match(line)
        if match:
            return match.group(1)[:80]
    return "no exception named"


def _sandbox_events(path: Path, limit: int = 4 << 20) -> list[dict]:
    """The graded kernel's record of its sandbox (grading.remote): restarts, timeouts, deaths, refusals."""
    events = []
    for line in sandbox.read_tail(path, limit).splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def _event_part(event: dict, cells: set[str], references: set[str]) -> str | None:
    """One event in the grader's own words. The cell is one of the lab's (else "a cell"); text the sandbox
    sent (a refused value's description, a reference's name) is never copied: a reference is named only
    when it is one the lab declares."""
    kind, cell = event.get("event"), str(event.get("cell"))
    cell = cell if cell in cells else "a cell"
    limits = event.get("limits")  # the limits its cgroup counted (the grader's reading of the kernel's counters)
    hit = f" ({'; '.join(str(limit)[:120] for limit in limits[:3])})" if isinstance(limits, list) and limits else ""
    if kind == "timeout":
        return f"cell {cell} timed out in the sandbox{hit}"
    if kind == "died":
        return f"the sandbox died in cell {cell}{hit}"
    if kind == "refused":
        what = str(event.get("what", ""))
        if what.startswith("the kernel cell"):
            return f"refused in {cell}: the kernel is not one the grader can run"
        return f"refused in {cell}: a value that is not plain data"
    if kind == "reference":
        what = str(event.get("what", ""))
        if what in references:
            return f"refused in {cell}: the reference {what} (unavailable in the sandbox)"
        return f"refused in {cell}: a reference of the lab (unavailable in the sandbox)"
    return None


def _cell_names(course: LabCourse) -> set[str]:
    names = {"start"}
    for index, cell in enumerate(course.release.cells):
        names.add(_nbgrader(cell).get("grade_id") or f"#{index}")
    return names


def _reason(flags: list[str], execute_report: dict, events: list[dict], extra: list[str], course: LabCourse,
            failed_tests: Mapping[str, str] = {}) -> tuple[str, str]:
    """(the whole reason, its general part): what happened to the notebook, in the grader's words, then one
    line per failed test (its name and the first line of what a student may read of its message)."""
    cells, references = _cell_names(course), references_named(course)
    parts = [f"the grader's kernel died in cell {name}" for name in execute_report.get("deaths", [])]
    parts += [f"cell {cell['name']} timed out" for cell in execute_report.get("cells", []) if cell["status"] == "timed out"]
    parts += [part for part in (_event_part(event, cells, references) for event in events) if part]
    general = "; ".join(dict.fromkeys([*parts, *flags, *extra]))
    lines = [f"{name}: {message}"[:300] for name, message in failed_tests.items()]
    return "\n".join(filter(None, [general, *lines])), general


def references_named(course: LabCourse) -> set[str]:
    names = {name for refs in course.references.values() for name in refs}
    if course.library is not None:
        names |= set(course.library.stubbed) | set(course.library.bans)
    return names


def _error_row(student: str, lab: str, course: LabCourse, reason: str, seconds: float = 0.0, log: str = "") -> dict:
    """A notebook the grader could not grade: status "error", no score (never a zero), the cause in words."""
    return {"student": student, "lab": lab, "status": "error", "reason": reason, "reason_general": reason,
            "score": None, "max_score": course.max_score, "manual_max_score": 0.0, "failures": {}, "errors": {},
            "flags": [], "notes": [], "zeroed": {}, "seconds": seconds, "kernel_s": 0.0, "slowest_cell_s": 0.0,
            "log": log}


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
    scratch: Path | None = None  # the sandbox's own folder, removed when the notebook is done
    tag: str = ""                # its sandboxes' cgroups: minillm-grading-<tag>-*
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


JOB_MEMORY_BYTES = 4 << 30  # a graded notebook's sandbox and kernel: the default model, a lab's engines


def default_jobs() -> int:
    """Notebooks at once: one per core, as many as memory holds at JOB_MEMORY_BYTES each."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8 << 30
    return max(1, min(cores, int(memory * 0.6) // JOB_MEMORY_BYTES))


SANDBOX_PYTHON: str | None = None  # the interpreter run inside the sandbox (default: the grader's own)


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
        "bans": library.bans, "env": env, "limits": {**vars(limits), "cpus": limits.cpus or float(threads)},  # its threads' cores
        "cache_root": str(cache_root()),
        "log": str(job.folder / "sandbox.log"), "report": str(job.folder / "sandbox.jsonl"),
        "cell_timeout_s": timeout_s, "call_timeout_s": timeout_s, "unsafe": unsafe, "python": SANDBOX_PYTHON or PYTHON,
        "run_id": run_id,
    }


def _run_job(job: _Job, env: dict, timeout_s: int, running: dict | None = None) -> _Job:
    """Run one graded copy in its own process (grading.execute): the grader's kernel and its sandbox."""
    kernel_timeout = 3 * timeout_s + 60  # a test may call the learner's code many times, each within timeout_s
    code_cells = sum(1 for c in job.copy.notebook.cells if c.cell_type == "code")
    wall_limit = 300 + kernel_timeout * max(1, code_cells)
    command = [PYTHON, "-m", "grading.execute", str(job.graded), str(job.executed), "--plan", str(job.folder / "plan.json"),
               "--report", str(job.folder / "execute.json"), "--timeout", str(kernel_timeout), "--cwd", str(job.folder / "kernel")]
    start = time.perf_counter()
    with open(job.folder / "execute.log", "wb") as out:  # on disk, read back with a limit
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        if running is not None:
            running[id(job)] = process
        try:
            process.wait(timeout=wall_limit)
            killed = ""
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            killed = f"\nkilled after {wall_limit} s"
        finally:
            if running is not None:
                running.pop(id(job), None)
    job.seconds, job.returncode = time.perf_counter() - start, process.returncode
    job.output = sandbox.read_tail(job.folder / "execute.log", LOG_TAIL_BYTES) + killed
    return job


def _sweep_sandboxes(run_id: str) -> list[int]:
    """Kill every process of every sandbox this run (or job: its tag) started, and remove their cgroups:
    nothing a submission started outlives its grading. Returns the pids that had to be killed."""
    killed = []
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/cpu"),
                 Path("/sys/fs/cgroup")):
        if not root.is_dir():
            continue
        for path in root.rglob(f"minillm-grading-{run_id}-*") if root.name == "cgroup" else root.glob(f"minillm-grading-{run_id}-*"):
            group = sandbox.Cgroup([path], 2 if root.name == "cgroup" else 1)
            killed += group.pids()
            group.kill()
    return killed


def _nbgrader_autograde(course_root: Path, lab: str, student: str, env: dict, log_path: Path) -> None:
    """nbgrader autograde for one student of ``lab``, the outputs replayed from the run (no kernel)."""
    command = [PYTHON, "-m", "nbgrader", "autograde", lab, "--student", student, "--force", "--create"]
    env = {**env, EXECUTED_ENV: str(course_root / "executed" / lab)}  # ReplayOutputs: nbgrader_config.py
    done = subprocess.run(command, cwd=course_root, env=env, capture_output=True, text=True, timeout=3600)
    log_path.write_text(f"# {' '.join(command)}\n{done.stdout[-LOG_TAIL_BYTES:]}\n{done.stderr[-LOG_TAIL_BYTES:]}",
                        encoding="utf-8")


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


def _start_failure(job: _Job) -> str | None:
    """Why the notebook's sandbox did not start, in words, or None. Its first start happens before any of the
    student's code runs, so its log then holds bubblewrap's own words only."""
    try:
        executed = nbformat.read(job.executed, as_version=4)
    except (OSError, ValueError):
        return None
    start = next((c for c in executed.cells if _nbgrader(c).get("grade_id") == SANDBOX_CELL_ID), None)
    error = next((o for o in (start.get("outputs", []) if start is not None else []) if o.get("output_type") == "error"), None)
    if error is None:
        return None
    log = sandbox.read_tail(job.folder / "sandbox.log", 4096)
    bwrap = [line.strip() for line in log.splitlines() if line.startswith("bwrap:")]
    if any("execvp" in line for line in bwrap):
        return f"sandbox: cannot execute the kernel's python inside the sandbox ({bwrap[-1][:200]})"
    if bwrap:
        return f"sandbox: bubblewrap failed ({bwrap[-1][:200]})"
    return f"sandbox: it did not start ({str(error.get('ename'))[:80]})"


def _machinery_failure(job: _Job, execute_report: dict, events: list[dict], autograded: Path) -> str | None:
    """Why the grader itself failed on this notebook (its kernel, its sandbox's start, nbgrader), or None."""
    if job.returncode != 0:
        return (f"the grader's run of the notebook failed ({_exception_name(job.output)}, exit {job.returncode}); "
                "see the log")
    started = _start_failure(job)
    if started:
        return started
    for event in events:
        if event.get("event") == "start_failed":
            return "sandbox: it could not be started again after a restart; see the log"
    if execute_report.get("deaths"):
        return f"the grader's kernel died in cell {execute_report['deaths'][0]}; see the log"
    if not autograded.is_file():
        return "nbgrader autograde wrote no notebook; see the log"
    return None


def _write_log(job: _Job, nbgrader_log: Path) -> None:
    header = [f"# {job.student} / {job.lab}: graded in {job.seconds:.1f} s", *[f"# flag: {f}" for f in job.copy.flags],
              *[f"# note: {n}" for n in job.copy.notes]]
    sandbox_text = sandbox.read_tail(job.folder / "sandbox.log", LOG_TAIL_BYTES)
    nbgrader_text = sandbox.read_tail(nbgrader_log, LOG_TAIL_BYTES)
    job.log.parent.mkdir(parents=True, exist_ok=True)
    job.log.write_text("\n".join(header) + f"\n{job.output}\n# the sandbox's own output:\n{sandbox_text}\n"
                       f"# nbgrader autograde:\n{nbgrader_text}", encoding="utf-8")


def _row(job: _Job, course: LabCourse, course_root: Path) -> dict:
    from grading import feedback

    lab, student = job.lab, job.student
    _write_log(job, job.folder / "nbgrader.log")
    try:
        execute_report = json.loads(sandbox.read_tail(job.folder / "execute.json", 4 << 20))
    except json.JSONDecodeError:
        execute_report = {}
    events = _sandbox_events(job.folder / "sandbox.jsonl")
    autograded = course_root / "autograded" / student / lab / f"{lab}.ipynb"
    broken = _machinery_failure(job, execute_report, events, autograded)
    if broken:
        row = _error_row(student, lab, course, broken, job.seconds, str(job.log))
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
    readable = feedback.failure_messages(autograded, course, zeroed)
    with open(job.log, "a", encoding="utf-8") as handle:  # the instructor's log keeps the messages whole
        handle.write("".join(f"# failed: {name}: {message[:2000]}\n" for name, message in failures.items()))
    reason, general = _reason(job.copy.flags, execute_report, events, [*job.copy.notes, *notes], course,
                              {name: readable.get(name, "failed") for name in failures})
    cells = execute_report.get("cells", [])
    return {
        "student": student, "lab": lab, "status": "graded", "reason": reason, "reason_general": general,
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
        if student.startswith(PREFLIGHT):
            raise ValueError(f"student id {student!r}: ids starting {PREFLIGHT!r} are the grader's preflight")
    return labs


class PreflightFailed(RuntimeError):
    """The lab's own solution or untouched copy did not grade as it must: nothing was graded (one line why)."""


@dataclass
class _Run:
    """What every notebook of one grading run shares."""

    course_root: Path
    outside: Path                     # the sandboxes' libraries and scratch folders (outside the course)
    courses: dict[str, LabCourse]
    logs: Path
    env: dict[str, str]
    threads: int
    quick: bool
    cell_timeout_s: int | None
    unsafe: bool
    limits: sandbox.Limits
    run_id: str
    feedback_dir: Path | None = None
    times: dict = field(default_factory=dict)
    gradebook: threading.Lock = field(default_factory=threading.Lock)  # nbgrader's sqlite: one writer
    running: dict = field(default_factory=dict)                        # id(job) -> its process
    counter: list = field(default_factory=lambda: [0])
    counter_lock: threading.Lock = field(default_factory=threading.Lock)

    def timeout_for(self, lab: str) -> int:
        if self.cell_timeout_s is not None:
            return self.cell_timeout_s
        return cell_timeout_for(lab, self.times) if self.quick else DEFAULT_CELL_TIMEOUT_S


def _prepare_job(run: _Run, student: str, lab: str, path: Path, log: Path) -> _Job:
    """The graded copy of one submission and its folders; SubmissionError when the file cannot be graded."""
    course = run.courses[lab]
    if not path.is_file():
        raise SubmissionError(f"no notebook at {path}")
    submission = read_submission(path)
    findings = check_cells(submission, course)
    graded = graded_copy(submission, course)
    graded.flags[:0] = findings
    target = run.course_root / "submitted" / student / lab / f"{lab}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(graded.notebook, target)
    timestamp = path.parent / "timestamp.txt"  # nbgrader's submission time (late penalties, feedback)
    if timestamp.is_file():
        shutil.copyfile(timestamp, target.parent / "timestamp.txt")
    folder = run.course_root / "reports" / student / lab
    (folder / "kernel").mkdir(parents=True, exist_ok=True)
    with run.counter_lock:
        run.counter[0] += 1
        number = run.counter[0]
    tag = f"{run.run_id}-{number}"
    scratch = run.outside / "scratch" / f"{student}-{lab}-{number}"
    scratch.mkdir(parents=True, exist_ok=True)
    nbformat.write(submission, scratch / f"{lab}.ipynb")  # the sandbox's copy of its notebook
    executed = run.course_root / "executed" / lab / student / f"{lab}.ipynb"
    executed.parent.mkdir(parents=True, exist_ok=True)
    job = _Job(student, lab, path, target, executed, folder, log, graded, scratch, tag)
    (folder / "plan.json").write_text(json.dumps(course.plan), encoding="utf-8")
    spec = _sandbox_spec(job, course, scratch, run.quick, run.timeout_for(lab), run.threads, run.unsafe, run.limits, tag)
    (folder / "sandbox.json").write_text(json.dumps(spec), encoding="utf-8")
    return job


def _grade(run: _Run, student: str, lab: str, path: Path) -> dict:
    """One notebook, start to row: whatever it does, it gets its row (``graded``, or ``error`` with the
    cause), its sandboxes are gone and its scratch folder removed before this returns."""
    course = run.courses[lab]
    log = run.logs / student / f"{lab}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    job = None
    try:
        job = _prepare_job(run, student, lab, Path(path), log)
        env = {**run.env, "MINILLM_SANDBOX_SPEC_PATH": str(job.folder / "sandbox.json"), "MINILLM_GRADING_RUN": job.tag}
        _run_job(job, env, run.timeout_for(lab), run.running)
        killed = _sweep_sandboxes(job.tag)
        if killed:
            job.copy.notes.append(f"{len(killed)} leftover sandbox processes were killed")
        with run.gradebook:
            _nbgrader_autograde(run.course_root, lab, student, env, job.folder / "nbgrader.log")
            row = _row(job, course, run.course_root)
            row["submitted_dir"] = str(Path(path).parent)
            if run.feedback_dir is not None:
                from grading import feedback

                feedback.write(row, run.course_root, course, run.feedback_dir)
        return row
    except SubmissionError as error:
        log.write_text(f"{path}: {error}\n", encoding="utf-8")
        row = _error_row(student, lab, course, str(error), time.perf_counter() - started, str(log))
    except Exception as error:  # noqa: BLE001 - the grader's own failure is this row's, not the class's
        import traceback

        with open(log, "a", encoding="utf-8") as handle:
            handle.write("# the grader failed on this notebook:\n" + traceback.format_exc())
        row = _error_row(student, lab, course, f"the grader failed on this notebook ({type(error).__name__}); see the log",
                         time.perf_counter() - started, str(log))
    finally:
        if job is not None and job.scratch is not None:
            shutil.rmtree(job.scratch, ignore_errors=True)
    row["submitted_dir"] = str(Path(path).parent)
    if run.feedback_dir is not None:
        from grading import feedback

        try:
            feedback.write(row, run.course_root, course, run.feedback_dir)
        except OSError as error:  # the row stands; the page is the instructor's to write again
            row["reason"] += f"; no feedback page ({type(error).__name__})"
    return row


def _make_run(course_root: Path, tmp: Path, labs: list[str], source_dir: Path, log_dir: Path | None, quick: bool,
              cell_timeout_s: int | None, jobs: int, unsafe: bool, limits: sandbox.Limits, feedback_dir) -> _Run:
    if course_root.exists() and any(course_root.iterdir()):
        raise FileExistsError(f"course folder {course_root} is not empty; give a new folder")
    outside = tmp / "sandboxes"  # outside the course folder: what the sandboxes see
    courses = prepare_course(course_root, labs, source_dir, library_dir=outside / "libraries")
    (course_root / "logs").mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    threads = _threads_per_job(jobs)
    env = {**_kernel_env(quick), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "MINILLM_GRADING_RUN": run_id}
    return _Run(course_root, outside, courses, Path(log_dir) if log_dir is not None else course_root / "logs", env,
                threads, quick, cell_timeout_s, unsafe, limits, run_id, Path(feedback_dir) if feedback_dir else None,
                quick_times())


def _grade_all(run: _Run, todo: list[tuple[str, str, Path]], jobs: int, done, bar=None) -> list[dict]:
    """Grade ``todo`` ``jobs`` at a time; ``done(row)`` as each ends. An interruption kills the running
    notebooks' processes and sandboxes, and keeps every row already done."""
    rows: list[dict] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    futures = [pool.submit(_grade, run, student, lab, path) for student, lab, path in todo]
    try:
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            rows.append(row)
            done(row)
            if bar is not None:
                bar.update(1)
                bar.write(f"{row['student']} / {row['lab']}: {_score_text(row)} in {row['seconds']:.0f} s")
    except BaseException:
        for future in futures:
            future.cancel()
        for process in list(run.running.values()):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _sweep_sandboxes(run.run_id)
    return rows


def _preflight(run: _Run, labs: list[str], source_dir: Path, jobs: int) -> None:
    """Grade each lab's own solution and its untouched student copy in the sandbox: full marks and 0, or
    PreflightFailed with the cause in one line (the sandbox cannot start, a check fails on this machine)."""
    rendered = render(source_dir, labs)
    folder = run.outside / "preflight"
    todo = []
    for lab in labs:
        for who, kind in (("solution", "solutions"), ("untouched", "labs")):
            path = folder / who / lab / f"{lab}.ipynb"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rendered[f"{kind}/{lab}.ipynb"], encoding="utf-8")
            todo.append((PREFLIGHT + who, lab, path))
    preflight_run = dataclasses.replace(run, logs=run.logs / "preflight", feedback_dir=None)
    problems = []
    for row in sorted(_grade_all(preflight_run, todo, jobs, lambda row: None), key=lambda r: (r["lab"], r["student"])):
        who, lab = row["student"][len(PREFLIGHT):], row["lab"]
        first = row["reason"].splitlines()[-1] if row["reason"] else ""
        full = row["max_score"] - row["manual_max_score"]
        if row["status"] != "graded":
            problems.append(f"{row['reason']} (grading {lab}'s {who} copy; log: {row['log']})")
        elif who == "solution" and (row["score"] != full or row["failures"]):
            problems.append(f"{lab}'s own solution scored {row['score']:g} of {full:g} in the sandbox ({first}; "
                            f"log: {row['log']})")
        elif who == "untouched" and row["score"] != 0:
            problems.append(f"{lab}'s untouched student copy scored {row['score']:g}, not 0 (log: {row['log']})")
    if problems:
        raise PreflightFailed("; ".join(dict.fromkeys(problems)))


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
    jobs: int | None = None,
    unsafe_no_sandbox: bool = False,
    similarity: bool = False,
    limits: sandbox.Limits | None = None,
    out_csv: Path | None = None,
    resume: bool = False,
    preflight: bool = True,
) -> list[dict]:
    """Autograde ``{student: {lab: notebook_path}}``; return one row per (student, lab), sorted by student
    then lab, whatever the notebooks do:

    ``status`` ("graded", or "error" when the notebook could not be graded: no file, not JSON, not a
    notebook, malformed cells, or the grader's own machinery failed on it; its ``score`` is then None,
    never a zero), ``reason`` (what happened, in the grader's words: timeouts and deaths, values refused,
    references reached, changed, deleted, unknown, duplicated or reordered cells, ignored manual scores,
    similarity flags; then one line per failed test with the first line of what a student may read of
    its message; "" when clean), ``score``, ``max_score``, ``manual_max_score`` (graded by hand, not in
    ``score`` yet), ``failures`` (graded test cells that earned nothing: ``"ErrorName: message"``, for the
    instructor), ``errors``, ``flags``, ``zeroed``, ``seconds``, ``kernel_s``, ``slowest_cell_s``, ``log``.

    ``preflight``: first grade each lab's own solution and untouched student copy in the sandbox; unless
    they score full marks and 0, raise PreflightFailed before any row is written. ``out_csv``: write each
    row there as it is done (a crash keeps the rows done); ``resume``: keep the rows already in ``out_csv``
    and grade only the others. ``jobs``: notebooks at once (default :func:`default_jobs`), each with its
    share of the cores. ``course_dir``: build the nbgrader course there and keep it. ``quick``:
    MINILLM_QUICK=1. ``cell_timeout_s``: per-cell limit (default: measured per lab). ``feedback_dir``:
    ``<student>/<lab>/<lab>.html`` pages there (no hidden test). ``log_dir``: each notebook's log as
    ``<student>/<lab>.log``. ``unsafe_no_sandbox``: run the submissions without the sandbox.
    ``similarity``: flag solution cells close to the references or another student's. ``limits``: the
    sandbox's limits (default: grading.sandbox.default_limits).
    """
    submissions = {student: {lab: Path(p) for lab, p in by_lab.items()} for student, by_lab in submissions.items()}
    labs = _check_request(submissions, discover_labs(source_dir))
    if not labs:
        return []
    if not unsafe_no_sandbox:
        sandbox.require()
    jobs = default_jobs() if jobs is None else max(1, int(jobs))
    kept = read_csv(out_csv) if resume and out_csv is not None and Path(out_csv).is_file() else {}
    todo = [(student, lab, submissions[student][lab]) for student in sorted(submissions)
            for lab in sorted(submissions[student]) if (student, lab) not in kept]
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as tmp:
        course_root = Path(course_dir) if course_dir is not None else Path(tmp) / "course"
        run = _make_run(course_root, Path(tmp), labs, source_dir, log_dir, quick, cell_timeout_s, jobs,
                        unsafe_no_sandbox, limits or sandbox.default_limits(jobs), feedback_dir)
        if preflight and todo:
            _preflight(run, sorted({lab for _, lab, _ in todo}), source_dir, jobs)
        writer = CsvWriter(out_csv, list(kept.values())) if out_csv is not None else None
        rows = _grade_class(run, todo, jobs, writer, progress)
        if similarity:
            _flag_similar(run, rows)
        ordered = sorted([*kept.values(), *rows], key=lambda r: (r["student"], r["lab"]))
        if writer is not None:
            writer.finish(ordered)
        return ordered


def _grade_class(run: _Run, todo: list[tuple[str, str, Path]], jobs: int, writer: "CsvWriter | None",
                 progress: bool) -> list[dict]:
    """The class's notebooks, each row to the CSV as it is done; with ``progress``, the estimate and a bar."""
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        print(estimate(todo, jobs, run.times), flush=True)
        bar = tqdm(total=len(todo), desc="autograde", unit="notebook")
    try:
        return _grade_all(run, todo, jobs, writer.add if writer else (lambda row: None), bar)
    finally:
        if bar is not None:
            bar.close()


def _flag_similar(run: _Run, rows: list[dict]) -> None:
    """Similarity flags in the rows' reasons (grading.similarity), and in the feedback pages of flagged rows."""
    from grading import feedback, similarity

    before = [(row.get("reason", ""), row.get("reason_general", "")) for row in rows]
    similarity.flag_rows(rows, run.courses, run.course_root)
    for row, (reason, general) in zip(rows, before):
        if not row.get("similarity"):
            continue
        flagged = row["reason"][len(reason):].lstrip("; ")  # the flags go with the notes, before the failed tests
        tests = reason.split("\n")[1:] if general else reason.split("\n") if reason else []
        row["reason_general"] = "; ".join(filter(None, [general, flagged]))
        row["reason"] = "\n".join([row["reason_general"], *tests])
        if run.feedback_dir is not None:
            feedback.write(row, run.course_root, run.courses[row["lab"]], run.feedback_dir)


# --- output ----------------------------------------------------------------------------------------

CSV_FIELDS = ["student", "lab", "status", "score", "max_score", "manual_max_score", "seconds", "reason"]


def _csv_line(row: dict) -> dict:
    score = row.get("score")
    return {**row, "score": "" if score is None else f"{score:g}", "seconds": f"{row.get('seconds', 0.0):.1f}"}


def write_csv(rows: list[dict], path: Path) -> None:
    """One line per (student, lab): student, lab, status, score (empty for an error), max_score,
    manual_max_score, seconds, reason (several lines: one per failed test). Written whole, then moved in
    place: a reader never sees half a file."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(_csv_line(row))
    os.replace(partial, path)


def read_csv(path: Path) -> dict[tuple[str, str], dict]:
    """The complete rows of a grades CSV (an interrupted run's last line may be cut), by (student, lab)."""
    rows = {}
    with open(path, newline="", encoding="utf-8") as handle:
        for line in csv.DictReader(handle):
            if line.get("status") not in ("graded", "error") or line.get("seconds") in (None, ""):
                continue
            try:
                row = {**line, "score": float(line["score"]) if line["score"] else None,
                       "max_score": float(line["max_score"]), "manual_max_score": float(line["manual_max_score"] or 0),
                       "seconds": float(line["seconds"])}
            except (TypeError, ValueError):
                continue
            row.update(failures={}, errors={}, flags=[], notes=[], zeroed={}, resumed=True,
                       reason_general=row["reason"].split("\n")[0])
            rows[(row["student"], row["lab"])] = row
    return rows


class CsvWriter:
    """The grades CSV as a run goes: the rows kept from before, then each row as it is done (flushed)."""

    def __init__(self, path: Path, kept: list[dict]):
        self.path, self.lock = Path(path), threading.Lock()
        write_csv(sorted(kept, key=lambda r: (r["student"], r["lab"])), self.path)
        self.handle = open(self.path, "a", newline="", encoding="utf-8")
        self.writer = csv.DictWriter(self.handle, fieldnames=CSV_FIELDS, extrasaction="ignore")

    def add(self, row: dict) -> None:
        with self.lock:
            self.writer.writerow(_csv_line(row))
            self.handle.flush()
            os.fsync(self.handle.fileno())

    def finish(self, rows: list[dict]) -> None:
        with self.lock:
            self.handle.close()
            write_csv(rows, self.path)


def _score_text(row: dict) -> str:
    if row["status"] != "graded":
        return "ERROR"
    return f"{row['score']:g} / {row['max_score']:g}" + (
        f" ({row['manual_max_score']:g} by hand)" if row.get("manual_max_score") else "")


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def estimate(todo: list[tuple], jobs: int, times: Mapping[str, dict]) -> str:
    """The run's expected wall time from each lab's measured solution (grading/quick_times.json)."""
    known = [times[lab]["quick_s"] for _, lab, _ in todo if lab in times]
    per = sum(known) / len(known) if known else 60.0
    total = per * len(todo) / jobs
    return (f"estimate: {len(todo)} notebooks at about {per:.0f} s each (their labs' solutions, "
            f"grading/quick_times.json), {jobs} at a time: about {_duration(total)}")


def format_table(rows: list[dict], times: Mapping[str, dict] | None = None) -> str:
    """A plain-text table: score, the failing graded cells, the time against the lab's measured
    quick-mode run, and the first line of the reason."""
    times = quick_times() if times is None else times
    header = ("student", "lab", "score", "time", "failed cells", "reason")
    lines = []
    for row in rows:
        reference = times.get(row["lab"], {}).get("quick_s")
        took = f"{row.get('seconds', 0.0):.0f} s" + (f" (solution {reference:.0f} s)" if reference else "")
        general = row.get("reason_general", row.get("reason", "")) or "-"
        lines.append((row["student"], row["lab"], _score_text(row), took, ", ".join(sorted(row["failures"])) or "-",
                      general.split("\n")[0]))
    widths = [max(len(str(item)) for item in column) for column in zip(header, *lines)]
    return "\n".join("  ".join(str(item).ljust(width) for item, width in zip(line, widths)).rstrip() for line in [header, *lines])


def summary(rows: list[dict], top: int = 5) -> str:
    """Counts by status, the slowest notebooks, the tests that failed most often."""
    from collections import Counter

    statuses = Counter(row["status"] for row in rows)
    timed = [row for row in rows if not row.get("resumed")]
    lines = [f"{len(rows)} notebooks: " + ", ".join(f"{count} {status}" for status, count in sorted(statuses.items()))]
    if timed:
        seconds = sorted(row["seconds"] for row in timed)
        lines.append(f"time per notebook: median {seconds[len(seconds) // 2]:.0f} s, longest {seconds[-1]:.0f} s "
                     f"({len(timed)} graded in this run)")
        slowest = sorted(timed, key=lambda r: -r["seconds"])[:top]
        lines.append("slowest: " + ", ".join(f"{r['student']} / {r['lab']} {r['seconds']:.0f} s" for r in slowest))
    failing = Counter(f"{row['lab']}:{name}" for row in rows for name in row.get("failures", {}))
    if failing:
        lines.append("most failed tests: " + ", ".join(f"{name} ({count})" for name, count in failing.most_common(top)))
    errors = [row for row in rows if row["status"] == "error"]
    for row in errors[:top]:
        lines.append(f"error: {row['student']} / {row['lab']}: {row['reason'].splitlines()[0] if row['reason'] else ''}")
    return "\n".join(lines)


def measure_quick_times(labs: list[str] | None = None, source_dir: Path = SOURCE_DIR,
                        solutions_dir: Path | None = None) -> dict[str, dict]:
    """Grade each lab's committed solution in quick mode and record its time and slowest cell."""
    import platform

    labs = discover_labs(source_dir) if labs is None else labs
    solutions_dir = REPO_ROOT / "solutions" if solutions_dir is None else Path(solutions_dir)
    rows = autograde({"solution": {lab: solutions_dir / f"{lab}.ipynb" for lab in labs}}, source_dir=source_dir,
                     cell_timeout_s=DEFAULT_CELL_TIMEOUT_S, progress=True, jobs=1, preflight=False)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    measured = {}
    for row in rows:
        if row["status"] != "graded" or row["failures"]:
            raise RuntimeError(f"the solution of {row['lab']} did not grade clean: {row['reason'] or row['failures']}")
        measured[row["lab"]] = {"quick_s": round(row["seconds"], 1), "cells_s": round(row["kernel_s"], 1),
                                "slowest_cell_s": round(row["slowest_cell_s"], 1), "measured_on": machine}
    return measured
