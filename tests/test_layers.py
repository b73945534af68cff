"""The structure stays as docs/ARCHITECTURE.md draws it: imports run down the floors, nothing imports in a
circle, every file is read in one sitting, and the document names every package and top-level module.

The floors are import-linter contracts in pyproject.toml (`lint-imports` runs them); the cycles are read
from the same import graph (grimp), imports inside functions included.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "minillm"
MAX_LINES = 400


@pytest.fixture(scope="module")
def graph():
    import grimp

    return grimp.build_graph("minillm", "grading")


def test_every_import_runs_down_the_floors():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    report = done.stdout[done.stdout.find("Contracts"):]
    assert done.returncode == 0, f"an import goes up a floor (pyproject.toml [tool.importlinter]):\n{report}"


def test_no_two_modules_import_each_other(graph):
    pairs = sorted({tuple(sorted((a, b))) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                    if a != b and a in graph.find_modules_directly_imported_by(b)})
    assert not pairs, "modules that import each other: " + "; ".join(f"{a} <-> {b}" for a, b in pairs)


def _child(module: str, package: str) -> str | None:
    """The direct child of ``package`` that ``module`` is or lies in (None: outside the package)."""
    if not module.startswith(package + "."):
        return None
    return package + "." + module[len(package) + 1:].split(".")[0]


def test_no_package_imports_in_a_circle(graph):
    """Inside every package, its files and subpackages (each squashed to one node) import in one direction."""
    packages = {m.rsplit(".", 1)[0] for m in graph.modules if "." in m} | {"minillm", "grading"}
    cycles = []
    for package in sorted(packages):
        edges = defaultdict(set)
        for module in graph.modules:
            source = _child(module, package)
            if source is None:
                continue
            for imported in graph.find_modules_directly_imported_by(module):
                target = _child(imported, package)
                if target is not None and target != source:
                    edges[source].add(target)
        state, stack = {}, []

        def visit(node):
            state[node] = "open"
            stack.append(node)
            for nxt in sorted(edges[node]):
                if state.get(nxt) == "open":
                    cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
                elif nxt not in state:
                    visit(nxt)
            stack.pop()
            state[node] = "done"

        for node in sorted(edges):
            if node not in state:
                visit(node)
    assert not cycles, "imports in a circle:\n" + "\n".join(cycles)


def test_every_engine_file_reads_in_one_sitting():
    """No file of minillm/ outside the lab helpers is over 400 lines (Python or C): split by concern."""
    long = [f"{path.relative_to(REPO_ROOT)}: {n} lines"
            for path in sorted(PACKAGE.rglob("*")) if path.suffix in (".py", ".c", ".h") and "lab" not in path.parts
            and (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines:\n" + "\n".join(long)


def _packages_and_top_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.iterdir()):
        if path.is_dir() and (path / "__init__.py").is_file():
            names.append(f"{path.name}/")
            names += [f"{path.name}/{sub.name}/" for sub in sorted(path.iterdir())
                      if sub.is_dir() and (sub / "__init__.py").is_file()]
        elif path.suffix == ".py" and path.name != "__init__.py":
            names.append(path.name)
    return names


def test_the_architecture_document_names_every_package_and_top_level_module():
    text = (REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = [name for name in _packages_and_top_modules()
               if not re.search(r"`(minillm/)?" + re.escape(name.rstrip("/")) + r"/?`", text)]
    assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"


def test_the_readme_links_the_architecture_instead_of_keeping_a_layout():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/ARCHITECTURE.md" in readme
    assert "## Layout" not in readme, "the README's layout section drifts: link docs/ARCHITECTURE.md instead"


def test_block_manager_is_plain_python():
    source = (PACKAGE / "engine" / "block_manager.py").read_text()
    assert "import torch" not in source, "the block manager stays free of torch (STYLE.md)"


def test_the_package_holds_no_instructor_pipeline():
    """The course build and the autograder live in grading/ at the repository root: minillm, which learners
    install and read, never imports them (import-linter's forbidden contract checks minillm -> grading too)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(PACKAGE)} imports {name}" for name in names
                          if name.split(".")[0] in {"grading", "nbgrader"}]
    assert not offenders, "\n".join(offenders)


def test_the_performance_page_holds_current_numbers_only():
    """docs/PERFORMANCE.md is a reference (current tables, the command beside each): history goes to docs/notes."""
    lines = (REPO_ROOT / "docs" / "PERFORMANCE.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"docs/PERFORMANCE.md has {len(lines)} lines: move superseded runs to docs/notes"
