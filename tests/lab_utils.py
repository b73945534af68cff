"""Shared helpers of the lab tests: a master notebook's nbgrader cells by grade_id, and its solution cells
run in one namespace or imported from a file, also as the module-scoped `solution` fixture a test file assigns
(`solution = solution_fixture(...)`).

pytest puts tests/ on sys.path (rootdir conftest), so the plain `from lab_utils import ...` works from
every test file.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import nbformat
import pytest


def nbgrader_cells(nb) -> dict:
    """{grade_id: (cell, its nbgrader metadata)} for every cell of nb that has nbgrader metadata."""
    return {c.metadata["nbgrader"]["grade_id"]: (c, c.metadata["nbgrader"]) for c in nb.cells if "nbgrader" in c.metadata}


def run_solution_cells(master: Path, namespace: dict) -> dict:
    """Exec the master's solution code cells, in order, into namespace (the lab module seeded there); returns it."""
    nb = nbformat.read(master, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution"):
            exec(compile(cell.source, f"<master:{cell.metadata['nbgrader']['grade_id']}>", "exec"), namespace)
    return namespace


def solution_fixture(master: Path, namespace: dict):
    """The module-scoped fixture `solution`: run_solution_cells(master, a copy of namespace)."""

    @pytest.fixture(scope="module")
    def solution() -> dict:
        """The master's solution cells, run in one namespace."""
        return run_solution_cells(master, dict(namespace))

    return solution


def notebook_functions(master: Path, *names: str, **namespace) -> dict:
    """{name: function} for experiments a master notebook defines in its own (not solution) code cells:
    the labs keep every experiment of about 30 lines in the notebook, where the learner reads it, and the
    tests call those very functions. Each `def` is run after every import of the notebook's code cells,
    in one namespace (seeded with `namespace`, e.g. the learner's functions it calls); a function may use
    only its arguments, imports and the seeded names."""
    nb = nbformat.read(master, as_version=4)
    imports, defs = [], {}
    for cell in nb.cells:
        if cell.cell_type != "code" or cell.metadata.get("nbgrader", {}).get("solution"):
            continue
        for node in ast.parse(cell.source).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imports.append(node)
            elif isinstance(node, ast.FunctionDef) and node.name in names:
                defs[node.name] = node
    missing = [name for name in names if name not in defs]
    assert not missing, f"{master.name} defines no {missing} in its code cells"
    scope = dict(namespace)
    exec(compile(ast.Module(body=imports + [defs[name] for name in names], type_ignores=[]), str(master), "exec"),
         scope)
    return {name: scope[name] for name in names}


def assert_master_structure(master: Path, exercises: set[str], graded: dict[str, int], points: int) -> None:
    """A master's nbgrader layout: every exercise a solution cell, the graded cells (grade_id -> points) locked and
    with hidden tests, the header's points total, no editable markdown but the model answers, the QUICK cell."""
    nb = nbformat.read(master, as_version=4)
    meta = nbgrader_cells(nb)
    for name in exercises:
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded_meta = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert {gid: m["points"] for gid, m in graded_meta.items()} == graded
    for gid in graded_meta:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded_meta[gid]["locked"]
    assert f"**Graded ({points} points)**" in nb.cells[0].source and sum(graded.values()) == points
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "BEGIN MODEL ANSWER" not in cell.source:
            assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source


def student_stubs(student: Path, exercises: set[str]) -> dict[str, str]:
    """The student copy's solution cells by grade_id: exactly `exercises`, each a stub (code that raises
    NotImplementedError, or an answer_* cell left to fill in), for the test to check that no solution leaked."""
    stubs = {gid: cell.source for gid, (cell, m) in nbgrader_cells(nbformat.read(student, as_version=4)).items()
             if m.get("solution")}
    assert set(stubs) == set(exercises)
    for gid, source in stubs.items():
        assert "raise NotImplementedError()" in source or gid.startswith("answer_"), gid
    return stubs


def graded_test_ids(master: Path) -> list[str]:
    """grade_id of every autograded test cell of the master, in order."""
    nb = nbformat.read(master, as_version=4)
    return [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if c.cell_type == "code"
            and c.metadata.get("nbgrader", {}).get("grade") and not c.metadata["nbgrader"].get("solution")]


def run_test_cell(master: Path, grade_id: str, namespace: dict) -> BaseException | None:
    """Exec one autograded test cell of the master, visible and hidden tests, in namespace; the exception it
    raised, or None when it passed."""
    cell, _ = nbgrader_cells(nbformat.read(master, as_version=4))[grade_id]
    try:
        exec(compile(cell.source, f"<master:{grade_id}>", "exec"), namespace)
    except Exception as exc:  # noqa: BLE001 - the caller judges it
        return exc
    return None


def assert_check_fails(master: Path, grade_id: str, namespace: dict, mistake: str, names_the_case: str) -> None:
    """The wrong-answer test of one graded check: the solution passes the test cell `grade_id` in a copy of
    namespace; with `mistake` (source that redefines the learner's code, a plausible wrong answer) exec'd
    over it, the cell fails with an AssertionError (CheckFailed is one) whose message contains
    `names_the_case` (the call and its arguments, or the case in words)."""
    passed = run_test_cell(master, grade_id, dict(namespace))
    assert passed is None, f"{grade_id}: the solution itself fails in this namespace: {passed!r}"
    scope = dict(namespace)
    exec(compile(mistake, f"<mistake for {grade_id}>", "exec"), scope)
    failure = run_test_cell(master, grade_id, scope)
    assert failure is not None, f"{grade_id} passed this mistake:\n{mistake}"
    assert isinstance(failure, AssertionError), (
        f"{grade_id} crashed on this mistake instead of failing a check: {type(failure).__name__}: {failure}\n{mistake}")
    message = str(failure)
    assert names_the_case in message, (
        f"{grade_id}'s failure does not name the case ({names_the_case!r} not in the message):\n{message}\n{mistake}")


def solution_source(master: Path, header: str, launcher_prefix: str) -> str:
    """header, the master's solution code cells and the code cell starting with launcher_prefix, as one module's
    source (Triton reads a kernel's source from its file, so the code must live in a real file, not in exec'd
    strings)."""
    nb = nbformat.read(master, as_version=4)
    parts = [header]
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and (meta.get("solution") or cell.source.startswith(launcher_prefix)):
            parts.append(cell.source)
    return "\n\n".join(parts) + "\n"


def import_file(path: Path, name: str) -> ModuleType:
    """The Python file at path, imported as a module called name (not added to sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def solution_module_fixture(master: Path, header: str, launcher_prefix: str, name: str):
    """The module-scoped fixture `solution`: solution_source(...) written to a temporary name.py, imported as name."""

    @pytest.fixture(scope="module")
    def solution(tmp_path_factory) -> ModuleType:
        """The master's solution cells and kernel launcher, imported from a file."""
        path = tmp_path_factory.mktemp(name) / f"{name}.py"
        path.write_text(solution_source(master, header, launcher_prefix))
        return import_file(path, name)

    return solution


# The probe lab "99_probe": a tiny master that needs no model, for the nbgrader round trips (grading, the exchange).
PROBE_LAB = "99_probe"
PROBE_MASTER_CELLS = [
    ("code", "import os", {}),
    (
        "code",
        "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
        {"grade_id": "double", "solution": True, "grade": False, "locked": False},
    ),
    ("code", "assert double(2) == 4", {"grade_id": "visible", "grade": True, "solution": False, "locked": True, "points": 1}),
    (
        "code",
        "assert double(0) == 0\n### BEGIN HIDDEN TESTS\nassert double(-3) == -6\n### END HIDDEN TESTS",
        {"grade_id": "hidden", "grade": True, "solution": False, "locked": True, "points": 2},
    ),
    (
        "code",
        'assert os.environ.get("MINILLM_QUICK") == "1", "quick mode did not reach the kernel"\n'
        'assert double(2) == 4, "double(2) in quick mode"',
        {"grade_id": "quick_mode", "grade": True, "solution": False, "locked": True, "points": 1},
    ),
]


def write_probe_master(source_dir: Path) -> Path:
    """Write the probe lab's master to source_dir/99_probe/99_probe.ipynb (a folder of masters like grading/source);
    returns its path. Solved: 4/4 points; untouched student copy: 0/4 (every test calls double)."""
    return write_master(source_dir, PROBE_LAB, PROBE_MASTER_CELLS)


def write_master(source_dir: Path, lab: str, cells: list[tuple], metadata: dict | None = None) -> Path:
    """Write a master of code cells to source_dir/lab/lab.ipynb: each cell (cell_type, source, nbgrader metadata,
    and optionally its other metadata, e.g. {"minillm": {"runs_in": "sandbox"}}); ``metadata``: the notebook's
    own (e.g. {"minillm": {"references": ...}})."""
    made = []
    for index, (_cell_type, source, nbgrader, *other) in enumerate(cells):
        meta = {"nbgrader": {**nbgrader, "schema_version": 3}} if nbgrader else {}
        meta.update(other[0] if other else {})
        made.append(nbformat.v4.new_code_cell(source, id=f"probe-{index}", metadata=meta))
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    master = nbformat.v4.new_notebook(cells=made, metadata={"kernelspec": kernelspec, **(metadata or {})})
    path = Path(source_dir) / lab / f"{lab}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(master, path)
    return path
