"""Autograde every submission in a folder and write the grades (instructors).

    python grading/autograde.py SUBMISSIONS_DIR [--out grades.csv] [--keep COURSE_DIR] [--full]

SUBMISSIONS_DIR holds ``<student_id>/<NN_topic>/<NN_topic>.ipynb`` (see grading/README.md).
Hidden tests come from the instructor masters in grading/source; the notebooks run headless
in quick mode (MINILLM_QUICK=1) unless --full is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from minillm.lab import grading
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from minillm.lab import grading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("submissions_dir", type=Path, help="folder of <student_id>/<NN_topic>/<NN_topic>.ipynb")
    parser.add_argument("--out", type=Path, default=Path("grades.csv"), help="CSV to write (default: grades.csv)")
    parser.add_argument("--labs", nargs="+", metavar="NN_topic", help="grade only these labs")
    parser.add_argument("--keep", type=Path, metavar="COURSE_DIR",
                        help="build the nbgrader course here and keep it (autograded notebooks, gradebook.db)")
    parser.add_argument("--full", action="store_true", help="run the labs in full mode, not MINILLM_QUICK=1")
    parser.add_argument("--cell-timeout", type=int, metavar="SECONDS", help="per-cell limit (default: course config)")
    args = parser.parse_args(argv)

    submissions = grading.find_submissions(args.submissions_dir)
    if args.labs:
        submissions = {s: {lab: p for lab, p in by_lab.items() if lab in args.labs} for s, by_lab in submissions.items()}
        submissions = {s: by_lab for s, by_lab in submissions.items() if by_lab}
    if not submissions:
        print(f"no submissions found under {args.submissions_dir} "
              "(expected <student_id>/<NN_topic>/<NN_topic>.ipynb)", file=sys.stderr)
        return 1
    count = sum(len(by_lab) for by_lab in submissions.values())
    print(f"autograding {count} notebooks from {len(submissions)} students ...", flush=True)
    rows = grading.autograde(submissions, course_dir=args.keep, quick=not args.full, cell_timeout_s=args.cell_timeout)
    grading.write_csv(rows, args.out)
    print(grading.format_table(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
