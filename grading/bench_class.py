"""Time a class: N copies of a lab's solution and a few bad notebooks, graded with --jobs 1 and 2 (instructors).

    python -m grading.bench_class [--lab 00_setup] [--copies 30] [--jobs 1 2] [--json FILE]

The class is what an instructor meets: ``--copies`` students who solved the lab (its committed solution),
one who handed in the untouched copy, one whose notebook is malformed (a grade_id that is a list), one
whose solution cell crashes its sandbox. Each --jobs value grades the whole class with the preflight,
as ``grading/autograde.py`` does, and the table shows the wall time, seconds per notebook and the rows by
status. Every solved copy must score full marks and the untouched one 0, else the command fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import nbformat

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from grading import grader  # noqa: E402
from grading.build import REPO_ROOT  # noqa: E402

CRASH = "import os\nos._exit(1)\n"


def write_class(folder: Path, lab: str, copies: int) -> dict[str, dict[str, Path]]:
    solution = (REPO_ROOT / "solutions" / f"{lab}.ipynb").read_text(encoding="utf-8")
    untouched = (REPO_ROOT / "labs" / f"{lab}.ipynb").read_text(encoding="utf-8")
    texts = {f"solved{n:03d}": solution for n in range(copies)}
    texts["untouched"] = untouched
    malformed = nbformat.reads(solution, as_version=4)
    graded = next(c for c in malformed.cells if c.metadata.get("nbgrader", {}).get("grade"))
    graded.metadata["nbgrader"]["grade_id"] = [graded.metadata["nbgrader"]["grade_id"]]
    texts["malformed"] = nbformat.writes(malformed)
    crashing = nbformat.reads(solution, as_version=4)
    first = next(c for c in crashing.cells if c.metadata.get("nbgrader", {}).get("solution") and c.cell_type == "code")
    first.source = CRASH + first.source
    texts["crashes"] = nbformat.writes(crashing)
    found = {}
    for student, text in texts.items():
        path = folder / student / lab / f"{lab}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        found[student] = {lab: path}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lab", default="00_setup")
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="minillm-class-") as tmp:
        submissions = write_class(Path(tmp) / "submitted", args.lab, args.copies)
        for jobs in args.jobs:
            start = time.perf_counter()
            rows = grader.autograde(submissions, jobs=jobs, progress=True, out_csv=Path(tmp) / f"grades-{jobs}.csv",
                                    log_dir=Path(tmp) / f"logs-{jobs}")
            wall = time.perf_counter() - start
            by_student = {row["student"]: row for row in rows}
            wrong = [s for s, r in by_student.items() if s.startswith("solved") and r["score"] != r["max_score"] - r["manual_max_score"]]
            if wrong or by_student["untouched"]["score"] != 0 or by_student["malformed"]["status"] != "error":
                print(f"jobs {jobs}: wrong rows: {wrong or 'untouched/malformed'}", file=sys.stderr)
                return 1
            statuses = {}
            for row in rows:
                statuses[row["status"]] = statuses.get(row["status"], 0) + 1
            results.append({"lab": args.lab, "jobs": jobs, "notebooks": len(rows), "wall_s": round(wall, 1),
                            "s_per_notebook": round(wall / len(rows), 1),
                            "median_notebook_s": sorted(r["seconds"] for r in rows)[len(rows) // 2],
                            "statuses": statuses})
            print(grader.summary(rows), flush=True)
    print(f"| lab | jobs | notebooks | wall | s per notebook (wall / notebooks) | median notebook | rows |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['lab']} | {r['jobs']} | {r['notebooks']} | {r['wall_s'] / 60:.1f} min | {r['s_per_notebook']:.1f} | "
              f"{r['median_notebook_s']:.0f} s | {', '.join(f'{n} {s}' for s, n in sorted(r['statuses'].items()))} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
