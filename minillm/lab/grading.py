"""Autograde lab submissions with nbgrader in a throwaway course; return one row per notebook.

The course is rebuilt from the instructor masters (grading/source) each time, so the hidden
tests come from the masters, never from what a student hands in. Each submission runs once,
headless, in quick mode (``MINILLM_QUICK=1`` reaches the kernel through the environment).

    rows = autograde({"ada": {"01_prefill_decode": "ada/01_prefill_decode.ipynb"}})
    # [{"student": "ada", "lab": "01_prefill_decode", "score": 6.0, "max_score": 6.0,
    #   "failures": {}, "errors": {}}]
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import nbformat

from minillm.lab.build import SOURCE_DIR, discover_labs, generate_assignments, make_course

STUDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*")
COURSE_ID = "minillm"
# The interpreter that runs nbgrader also runs the kernel ("python3" kernelspec -> sys.executable).
PYTHON = sys.executable


def find_submissions(submissions_dir: Path) -> dict[str, dict[str, Path]]:
    """``SUBMISSIONS_DIR/<student_id>/<NN_topic>/<NN_topic>.ipynb`` as ``{student: {lab: path}}``."""
    submissions_dir = Path(submissions_dir)
    if not submissions_dir.is_dir():
        raise FileNotFoundError(f"no submissions folder at {submissions_dir}")
    found: dict[str, dict[str, Path]] = {}
    for notebook in sorted(submissions_dir.glob("*/*/*.ipynb")):
        student, lab = notebook.parent.parent.name, notebook.parent.name
        if notebook.stem != lab or ".ipynb_checkpoints" in notebook.parts:
            continue
        found.setdefault(student, {})[lab] = notebook
    return found


def _check_request(submissions: Mapping[str, Mapping[str, Path]], known_labs: list[str]) -> list[str]:
    labs = sorted({lab for by_lab in submissions.values() for lab in by_lab})
    unknown = [lab for lab in labs if lab not in known_labs]
    if unknown:
        raise ValueError(f"no master for lab(s) {unknown}; labs with a master: {known_labs}")
    for student, by_lab in submissions.items():
        if not STUDENT_ID.fullmatch(student):
            raise ValueError(f"student id {student!r} must match {STUDENT_ID.pattern} (it becomes a folder name)")
        for lab, path in by_lab.items():
            if not Path(path).is_file():
                raise FileNotFoundError(f"submission of {student} for {lab} not found: {path}")
    return labs


def _kernel_env(quick: bool) -> dict[str, str]:
    env = dict(os.environ)
    # Creating the gradebook shells out to `alembic`, found on PATH only when the venv is active.
    env["PATH"] = os.pathsep.join([str(Path(PYTHON).parent), env.get("PATH", "")])
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
        nbgrader = cell.metadata.get("nbgrader", {})
        name = nbgrader.get("grade_id") or cell.get("id") or f"cell {index}"
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                message = f"{output.get('ename')}: {output.get('evalue')}".strip()
                errors[name] = message
                if nbgrader.get("grade"):
                    failures[name] = message
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


def _read_grades(course_root: Path, submissions: Mapping[str, Mapping[str, Path]]) -> list[dict]:
    from nbgrader.api import Gradebook

    rows = []
    db_url = "sqlite:///" + str(course_root / "gradebook.db")
    with Gradebook(db_url, COURSE_ID) as gradebook:
        for student in sorted(submissions):
            for lab in sorted(submissions[student]):
                submission = gradebook.find_submission(lab, student)
                failures, errors = _errors(course_root / "autograded" / student / lab / f"{lab}.ipynb")
                rows.append(
                    {
                        "student": student,
                        "lab": lab,
                        "score": float(submission.score),
                        "max_score": float(submission.max_score),
                        "manual_max_score": _manual_max_score(submission),
                        "failures": failures,
                        "errors": errors,
                    }
                )
    return rows


def autograde(
    submissions: Mapping[str, Mapping[str, Path | str]],
    *,
    source_dir: Path = SOURCE_DIR,
    course_dir: Path | None = None,
    quick: bool = True,
    cell_timeout_s: int | None = None,
) -> list[dict]:
    """Autograde ``{student: {lab: notebook_path}}``; return rows sorted by student then lab:
    ``{"student", "lab", "score", "max_score", "manual_max_score", "failures", "errors"}`` where
    ``manual_max_score`` is the part of ``max_score`` graded by hand (not in ``score`` yet), ``failures`` maps
    the graded test cells that raised to ``"ErrorName: message"`` and ``errors`` does the same
    for every code cell (a solution should have none: the graded run executes the whole
    notebook, hidden tests included, headless with nbclient).

    ``course_dir``: build the nbgrader course there and keep it (autograded copies, gradebook)
    instead of in a temporary folder. ``quick``: run the labs with MINILLM_QUICK=1.
    ``cell_timeout_s`` overrides the per-cell limit of grading/nbgrader_config.py.
    """
    submissions = {student: {lab: Path(p) for lab, p in by_lab.items()} for student, by_lab in submissions.items()}
    labs = _check_request(submissions, discover_labs(source_dir))
    if not labs:
        return []
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as tmp:
        course_root = Path(course_dir) if course_dir is not None else Path(tmp) / "course"
        if course_root.exists() and any(course_root.iterdir()):
            raise FileExistsError(f"course folder {course_root} is not empty; give a new folder")
        make_course(course_root, labs, source_dir)
        generate_assignments(course_root, labs)  # registers labs, graded cells, hidden tests
        for student, by_lab in submissions.items():
            for lab, path in by_lab.items():
                target = course_root / "submitted" / student / lab / f"{lab}.ipynb"
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
        env = _kernel_env(quick)
        for lab in labs:
            command = [PYTHON, "-m", "nbgrader", "autograde", lab, "--force", "--create"]
            if cell_timeout_s is not None:
                command.append(f"--Execute.timeout={int(cell_timeout_s)}")
            result = subprocess.run(command, cwd=course_root, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(
                    f"nbgrader autograde {lab} failed (exit {result.returncode}):\n{result.stdout[-4000:]}"
                    f"\n{result.stderr[-8000:]}"
                )
        return _read_grades(course_root, submissions)


def write_csv(rows: list[dict], path: Path) -> None:
    """One line per (student, lab): student, lab, score, max_score."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["student", "lab", "score", "max_score"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def format_table(rows: list[dict]) -> str:
    """A plain-text table of the rows, with the failing graded cells of each."""
    header = ("student", "lab", "score", "failed cells")
    lines = [
        (row["student"], row["lab"], f"{row['score']:g} / {row['max_score']:g}"
         + (f" ({row['manual_max_score']:g} by hand)" if row.get("manual_max_score") else ""),
         ", ".join(sorted(row["failures"])) or "-")
        for row in rows
    ]
    widths = [max(len(str(item)) for item in column) for column in zip(header, *lines)]
    return "\n".join("  ".join(str(item).ljust(width) for item, width in zip(line, widths)).rstrip() for line in [header, *lines])
