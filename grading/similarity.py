"""Solution cells that look copied: from the lab's references, from the published solution, from each other.

No sandbox stops a student from pasting code: the engine and its lab helpers are installed on every
learner's machine, ``solutions/`` is public, and classmates talk. This report compares each solution cell,
after normalizing it, with

- the references the lab declares for that exercise (grading.references: ``reference_*`` helpers, the
  engine's implementation of the part),
- the master's own solution of the cell (what ``solutions/`` shows),
- the same cell of every other student,

and names the close matches. Normalizing keeps the program's shape and drops what a copier changes
cheaply: comments, docstrings, the names of local variables, arguments and functions (renamed in order of
first use), the values of constants; the names of library calls (``torch.softmax``) and attributes stay.
The ratio is difflib's ``SequenceMatcher`` over the normalized tokens. Cells shorter than
``MIN_TOKENS`` normalized tokens are skipped: there is one way to write ``2 * a * b``.

    python grading/similarity.py SUBMISSIONS_DIR [--labs NN_topic ...] [--csv similarity.csv]
    python grading/autograde.py SUBMISSIONS_DIR --similarity        # flags go to the grades' reason column

A flag is a lead for the instructor, not a verdict: read the two cells.
"""

from __future__ import annotations

import argparse
import ast
import csv
import difflib
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a script: the pipeline is the package `grading` of the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

MIN_TOKENS = 40             # normalized tokens below which a cell is not compared
STUDENT_THRESHOLD = 0.92    # two students' cells at least this alike are flagged
REFERENCE_THRESHOLD = 0.85  # a cell at least this like a reference or the published solution is flagged


class _Normalizer(ast.NodeVisitor):
    """Tokens of a program's shape: node kinds, library names and attributes; local names numbered."""

    def __init__(self, local_names: set[str]):
        self.local_names = local_names
        self.renamed: dict[str, str] = {}
        self.tokens: list[str] = []

    def name(self, identifier: str) -> str:
        if identifier not in self.local_names:
            return identifier
        if identifier not in self.renamed:
            self.renamed[identifier] = f"v{len(self.renamed)}"
        return self.renamed[identifier]

    def generic_visit(self, node):
        self.tokens.append(type(node).__name__)
        super().generic_visit(node)

    def visit_Name(self, node):
        self.tokens += ["Name", self.name(node.id)]

    def visit_arg(self, node):
        self.tokens += ["arg", self.name(node.arg)]

    def visit_Attribute(self, node):
        self.tokens.append("Attribute")
        self.visit(node.value)
        self.tokens.append("." + node.attr)

    def visit_Constant(self, node):
        self.tokens += ["Constant", type(node.value).__name__]

    def visit_FunctionDef(self, node):
        self.tokens += ["def", self.name(node.name)]
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        for child in [node.args, *node.decorator_list, *body] + ([node.returns] if node.returns else []):
            self.visit(child)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.tokens += ["class", self.name(node.name)]
        for child in [*node.bases, *node.keywords, *node.body]:
            self.visit(child)

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a bare string: a docstring or a comment in disguise
        self.generic_visit(node)


def _local_names(tree: ast.AST) -> set[str]:
    """Names the code itself binds (assigned, arguments, defined): these a copier renames freely."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def normalize(source: str) -> list[str]:
    """The normalized tokens of ``source`` (a cell or a function); [] when it does not parse."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return []
    normalizer = _Normalizer(_local_names(tree))
    for statement in tree.body:
        normalizer.visit(statement)
    return normalizer.tokens


def ratio(a: list[str], b: list[str]) -> float:
    """How alike two token lists are, 0..1 (difflib's SequenceMatcher ratio)."""
    if not a or not b:
        return 0.0
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    if matcher.real_quick_ratio() < min(STUDENT_THRESHOLD, REFERENCE_THRESHOLD):
        return matcher.real_quick_ratio()
    return matcher.ratio()


@dataclass
class Match:
    student: str
    lab: str
    cell: str
    other: str        # "student ada", "reference minillm.lab.lab02.reference_attend", "the published solution"
    similarity: float

    def describe(self) -> str:
        return f"{self.cell} is {self.similarity:.0%} like {self.other}'s"


def _is_stub(source: str) -> bool:
    """A cell the student left as released: the stub's raise is still there, either in a short cell or under
    nbgrader's "YOUR CODE HERE" (a kernel's stub keeps its given setup lines, so it is not short)."""
    if "raise NotImplementedError()" not in source:
        return False
    return "# YOUR CODE HERE" in source or len(normalize(source)) < MIN_TOKENS


def compare(cells: dict[str, dict[str, str]], references_by_cell: dict[str, list[tuple[str, str]]],
            solutions: dict[str, str], lab: str) -> list[Match]:
    """Matches in one lab. ``cells``: {student: {grade_id: source}}; ``references_by_cell``: {grade_id:
    [(name, source)]}; ``solutions``: {grade_id: the master's solution source}."""
    normalized = {student: {cell: normalize(source) for cell, source in by_cell.items() if not _is_stub(source)}
                  for student, by_cell in cells.items()}
    references = {cell: [(name, normalize(source)) for name, source in refs] for cell, refs in references_by_cell.items()}
    published = {cell: normalize(source) for cell, source in solutions.items()}
    matches: list[Match] = []
    students = sorted(normalized)
    for student in students:
        for cell, tokens in sorted(normalized[student].items()):
            if len(tokens) < MIN_TOKENS:
                continue
            for name, reference in references.get(cell, []):
                if len(reference) >= MIN_TOKENS and (similarity := ratio(tokens, reference)) >= REFERENCE_THRESHOLD:
                    matches.append(Match(student, lab, cell, f"the reference {name}", similarity))
            if cell in published and (similarity := ratio(tokens, published[cell])) >= REFERENCE_THRESHOLD:
                matches.append(Match(student, lab, cell, "the published solution", similarity))
    for index, student in enumerate(students):
        for other in students[index + 1:]:
            for cell, tokens in sorted(normalized[student].items()):
                theirs = normalized[other].get(cell)
                if theirs is None or min(len(tokens), len(theirs)) < MIN_TOKENS:
                    continue
                if (similarity := ratio(tokens, theirs)) >= STUDENT_THRESHOLD:
                    matches.append(Match(student, lab, cell, f"student {other}", similarity))
                    matches.append(Match(other, lab, cell, f"student {student}", similarity))
    return matches


def _solution_cells(nb) -> dict[str, str]:
    found = {}
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") == "code" and meta.get("solution") and meta.get("grade_id"):
            source = cell.get("source", "")
            found[meta["grade_id"]] = "".join(source) if isinstance(source, list) else str(source)
    return found


def lab_matches(lab: str, notebooks: dict[str, object], source_dir: Path | None = None) -> list[Match]:
    """Matches of one lab from ``{student: notebook}`` (nbformat nodes)."""
    from grading import build, references

    master = build.read_master(lab, source_dir or build.SOURCE_DIR)
    solutions = {cell: _strip_markers(source) for cell, source in _solution_cells(master).items()}
    refs = references.reference_sources(references.declared(master))
    cells = {student: _solution_cells(nb) for student, nb in notebooks.items()}
    return compare(cells, refs, solutions, lab)


def _strip_markers(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line)


def flag_rows(rows: list[dict], courses: dict, course_root: Path) -> None:
    """Add each row's matches to its ``reason`` and to ``row["similarity"]`` (the graded copies in
    ``course_root/submitted`` hold the students' solution cells)."""
    import nbformat

    by_lab: dict[str, dict[str, object]] = {}
    for row in rows:
        path = Path(course_root) / "submitted" / row["student"] / row["lab"] / f"{row['lab']}.ipynb"
        if path.is_file():
            by_lab.setdefault(row["lab"], {})[row["student"]] = nbformat.read(path, as_version=4)
    found: dict[tuple[str, str], list[Match]] = {}
    for lab, notebooks in by_lab.items():
        for match in lab_matches(lab, notebooks):
            found.setdefault((match.student, lab), []).append(match)
    for row in rows:
        matches = found.get((row["student"], row["lab"]), [])
        row["similarity"] = [m.__dict__ for m in matches]
        if matches:
            flagged = "; ".join(f"flagged: {m.describe()}" for m in matches)
            row["reason"] = f"{row['reason']}; {flagged}" if row.get("reason") else flagged


def main(argv: list[str] | None = None) -> int:
    import nbformat

    from grading import build

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("submissions_dir", type=Path, help="folder of <student_id>/<NN_topic>/<NN_topic>.ipynb")
    parser.add_argument("--labs", nargs="+", metavar="NN_topic")
    parser.add_argument("--csv", type=Path, help="also write the matches to this CSV")
    args = parser.parse_args(argv)
    submissions = build.find_submissions(args.submissions_dir)
    labs = set(args.labs or build.discover_labs())
    matches: list[Match] = []
    for lab in sorted(labs):
        notebooks = {}
        for student, by_lab in submissions.items():
            path = by_lab.get(lab)
            if path is not None and path.is_file():
                try:
                    notebooks[student] = nbformat.read(path, as_version=4)
                except Exception as error:  # noqa: BLE001 - a broken notebook is skipped, named
                    print(f"skipping {path}: {error}", file=sys.stderr)
        if notebooks:
            matches += lab_matches(lab, notebooks)
    for match in matches:
        print(f"{match.student}  {match.lab}  {match.describe()}")
    if not matches:
        print("no close matches")
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=["student", "lab", "cell", "other", "similarity"])
            writer.writeheader()
            for match in matches:
                writer.writerow({**match.__dict__, "similarity": f"{match.similarity:.3f}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
