"""What each lab asks of the learner, counted from its master: the rubric of grading/README.md.

    python -m grading.report          # = make labs-report: one row per lab, then every problem; exit 1 on any

It ends with each lab's time (grading.timing): the full-mode compute measured on this machine, reading estimated
from the word count, writing from the lines to write, against the time the header states.

A lab's code cells are of four kinds:

- **written**: nbgrader solution cells, the learner's code (``measure_*`` ones are measurements the learner
  writes: runs of the engine and the arithmetic on them; ``answer_*`` ones are short answers a test checks);
- **predictions**: cells that assign a ``predicted_*`` variable for the learner to fill in;
- **tests**: autograded test cells;
- **run-only**: everything else (imports, experiments defined in locked cells, printouts, figures).

The rubric, checked here for every lab:

- every markdown cell that says *Predict* is followed, before the next markdown cell, by a code cell that
  assigns a ``predicted_*`` variable, and a later code cell reads that variable (to echo it beside the
  measured value, ``echo_prediction``);
- at least one ``measure_*`` solution cell, and a test cell that grades it;
- at least one ``answer_*`` solution cell (a number or a short choice) and a test cell that grades it;
- at least one ``### BEGIN MODEL ANSWER`` region (the model answers of the explain questions, in solutions/);
- the header (first cell) has a points table whose rows add up to the lab's points, names that total
  ("N points"), and gives the quick-mode note (``MINILLM_QUICK=1``).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grading import timing
from grading.build import SOURCE_DIR, discover_labs, model_answer_regions, read_master

PREDICT = re.compile(r"\bPredict\b")
PREDICTED_PREFIX = "predicted_"
MEASURE_PREFIX = "measure_"
ANSWER_PREFIX = "answer_"
QUICK_NOTE = "MINILLM_QUICK=1"


@dataclass
class LabReport:
    lab: str
    written: int = 0
    run_only: int = 0
    prediction_cells: int = 0
    tests: int = 0
    measurements: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    model_answers: int = 0
    predictions: list[str] = field(default_factory=list)     # predicted_* names, in order
    points: float = 0.0
    problems: list[str] = field(default_factory=list)


def _nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def _assigned_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _read_names(tree: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def _parse(source: str) -> ast.AST:
    try:
        return ast.parse(source)
    except SyntaxError:  # IPython magics: leave the cell out of the name analysis
        return ast.Module(body=[], type_ignores=[])


def _header_points(header: str) -> list[float]:
    """The numbers in the last column of the header's markdown table rows (not the separator, not a total row)."""
    values = []
    for line in header.splitlines():
        line = line.strip()
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        if cells[0].lower().startswith("total"):
            continue
        try:   # "2", or "1 + 1" for a graded group of cells
            values.append(sum(float(part) for part in cells[-1].split("+")))
        except ValueError:
            continue
    return values


def report_lab(lab: str, source_dir: Path = SOURCE_DIR) -> LabReport:
    nb = read_master(lab, source_dir)
    rep = LabReport(lab)
    trees = [_parse(c.source) if c.cell_type == "code" else None for c in nb.cells]
    graded_sources = " ".join(c.source for c in nb.cells if _nbgrader(c).get("grade") and c.cell_type == "code")
    for index, cell in enumerate(nb.cells):
        meta = _nbgrader(cell)
        rep.points += float(meta.get("points", 0) or 0) if meta.get("grade") else 0.0
        rep.model_answers += len(model_answer_regions(cell.source))
        if cell.cell_type != "code":
            continue
        if meta.get("solution"):
            rep.written += 1
            grade_id = meta.get("grade_id", "")
            for prefix, bucket in ((MEASURE_PREFIX, rep.measurements), (ANSWER_PREFIX, rep.answers)):
                if grade_id.startswith(prefix):
                    bucket.append(grade_id)
                    defined = _assigned_names(trees[index]) | {n.name for n in ast.walk(trees[index])
                                                               if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                    if not any(re.search(rf"\b{re.escape(name)}\b", graded_sources) for name in defined):
                        rep.problems.append(f"{lab}: nothing in a graded test cell reads what {grade_id} defines")
        elif meta.get("grade"):
            rep.tests += 1
        elif any(name.startswith(PREDICTED_PREFIX) for name in _assigned_names(trees[index])):
            rep.prediction_cells += 1
        else:
            rep.run_only += 1

    # every Predict is recorded in a predicted_* variable, and read again later
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown" or not PREDICT.search(cell.source):
            continue
        names = []
        for later in range(index + 1, len(nb.cells)):
            if nb.cells[later].cell_type == "markdown":
                break
            names += sorted(n for n in _assigned_names(trees[later]) if n.startswith(PREDICTED_PREFIX))
        title = cell.source.strip().splitlines()[0][:60]
        if not names:
            rep.problems.append(f"{lab} cell {index} ({title!r}): a Predict with no predicted_* variable in the "
                                "code cells that follow it")
            continue
        for name in names:
            rep.predictions.append(name)
            defined_in = next(i for i in range(index + 1, len(nb.cells)) if trees[i] is not None
                              and name in _assigned_names(trees[i]))
            if not any(trees[i] is not None and name in _read_names(trees[i]) for i in range(defined_in + 1, len(nb.cells))):
                rep.problems.append(f"{lab}: {name} is never read after it is set (echo it beside the measurement)")

    if not rep.measurements:
        rep.problems.append(f"{lab}: no measurement the learner writes (a solution cell with grade_id measure_*)")
    if not rep.answers:
        rep.problems.append(f"{lab}: no checked short answer (a solution cell with grade_id answer_*)")
    if not rep.model_answers:
        rep.problems.append(f"{lab}: no model answers (### BEGIN MODEL ANSWER in a markdown cell)")
    header = nb.cells[0].source if nb.cells else ""
    table = _header_points(header)
    total = f"{rep.points:g}"
    if not table:
        rep.problems.append(f"{lab}: the header has no points table (| exercise | points |)")
    elif abs(sum(table) - rep.points) > 1e-9:
        rep.problems.append(f"{lab}: the header's points table adds up to {sum(table):g}, the graded cells to {total}")
    if f"{total} points" not in header:
        rep.problems.append(f"{lab}: the header does not say '{total} points'")
    if QUICK_NOTE not in header:
        rep.problems.append(f"{lab}: the header has no quick-mode note ({QUICK_NOTE})")
    return rep


def report(labs: list[str] | None = None, source_dir: Path = SOURCE_DIR) -> list[LabReport]:
    return [report_lab(lab, source_dir) for lab in (discover_labs(source_dir) if labs is None else labs)]


def format_table(reports: list[LabReport]) -> str:
    head = (f"{'lab':<26}{'written':>8}{'run-only':>9}{'predict':>8}{'tests':>6}{'points':>7}"
            f"{'measure':>8}{'answer':>7}{'model':>6}  predictions")
    lines = [head, "-" * len(head)]
    for r in reports:
        lines.append(f"{r.lab:<26}{r.written:>8}{r.run_only:>9}{r.prediction_cells:>8}{r.tests:>6}{r.points:>7g}"
                     f"{len(r.measurements):>8}{len(r.answers):>7}{r.model_answers:>6}  {', '.join(r.predictions) or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grading.report", description=__doc__.split("\n")[0])
    parser.add_argument("labs", nargs="*", help="only these labs (default: every master)")
    parser.add_argument("--source", type=Path, default=SOURCE_DIR, help="folder of instructor masters")
    args = parser.parse_args(argv)
    reports = report(args.labs or None, args.source)
    print(format_table(reports))
    print("written: solution cells; run-only: code cells the learner runs but does not write; predict: cells that "
          "set a predicted_* variable;\nmeasure / answer: solution cells graded as a measurement / a short answer; "
          "model: model answers of the explain questions")
    problems = [p for r in reports for p in r.problems]
    rows = [timing.estimate(r.lab, args.source) for r in reports]
    print("\n" + timing.format_table(rows))
    problems += [p for row in rows for p in timing.problems(row)]
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print("\nevery lab follows the rubric (grading/README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
