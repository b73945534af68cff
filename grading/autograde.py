"""Autograde every submission in a folder, write the grades, the logs and the feedback (instructors).

    python grading/autograde.py SUBMISSIONS_DIR [--out grades.csv] [--feedback DIR] [--jobs N] [--resume]
                                [--similarity] [--keep COURSE_DIR] [--full] [--unsafe-no-sandbox]
    python grading/autograde.py --check-sandbox # can this machine make the sandbox? what does it enforce?
    python grading/autograde.py --measure       # time each lab's solution in quick mode -> grading/quick_times.json

SUBMISSIONS_DIR holds ``<student_id>/<NN_topic>/<NN_topic>.ipynb`` (nbgrader's submitted/ folder
has this layout; see grading/README.md). Only the students' solution cells are run, each notebook's
in a sandbox (bubblewrap: no course, gradebook or repository in sight, no network, limited, killed
whole); tests and hidden tests come from the instructor masters in grading/source and run outside it.
First a preflight grades each lab's own solution and untouched student copy in the sandbox: unless they
score full marks and 0, nothing is graded and the cause is printed in one line. Then every notebook gets
a row, written to the CSV as it is done (``--resume`` grades only the notebooks without one), the log of
its grading lands in ``<out>.logs/<student>/<lab>.log``, and the exit status is the number of notebooks
with status "error" (0: all graded; 2 when no sandbox can be made or the preflight fails).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a script: the pipeline is the package `grading` of the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from grading import grader, sandbox  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("submissions_dir", type=Path, nargs="?", help="folder of <student_id>/<NN_topic>/<NN_topic>.ipynb")
    parser.add_argument("--out", type=Path, default=Path("grades.csv"), help="CSV to write (default: grades.csv)")
    parser.add_argument("--feedback", type=Path, metavar="DIR",
                        help="write DIR/<student>/<lab>/<lab>.html for each notebook (scores, failing tests, no hidden tests)")
    parser.add_argument("--labs", nargs="+", metavar="NN_topic", help="grade only these labs")
    parser.add_argument("--source", type=Path, default=grader.SOURCE_DIR, help="folder of instructor masters")
    parser.add_argument("--keep", type=Path, metavar="COURSE_DIR",
                        help="build the nbgrader course here and keep it (graded copies, autograded notebooks, gradebook.db)")
    parser.add_argument("--full", action="store_true", help="run the labs in full mode, not MINILLM_QUICK=1")
    parser.add_argument("--cell-timeout", type=int, metavar="SECONDS",
                        help="per-cell limit (default: 5x the lab's slowest solution cell, grading/quick_times.json)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="grade N notebooks at once, each in its own sandbox with its share of the cores "
                             f"(default: what the cores and memory allow, {grader.default_jobs()} here)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in --out (an interrupted run's) and grade only the others")
    parser.add_argument("--similarity", action="store_true",
                        help="flag solution cells close to the lab's references, the published solution or another "
                             "student's (grading/similarity.py) in the reason column")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="run the submissions without the sandbox (only where none can be made, on trusted code)")
    parser.add_argument("--check-sandbox", action="store_true", help="say whether the sandbox works here, and exit")
    parser.add_argument("--measure", action="store_true",
                        help="grade each lab's committed solution in quick mode and write grading/quick_times.json")
    args = parser.parse_args(argv)

    if args.check_sandbox:
        found = sandbox.status()
        print(f"sandbox: {found.isolation}" if found.available else f"no sandbox: {found.reason}")
        return 0 if found.available else 2
    if args.measure:
        measured = grader.measure_quick_times(args.labs, args.source)
        times = {**grader.quick_times(), **measured}
        grader.QUICK_TIMES.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        for lab, entry in sorted(measured.items()):
            print(f"{lab}: graded in {entry['quick_s']:.1f} s ({entry['cells_s']:.1f} s in its cells), "
                  f"slowest cell {entry['slowest_cell_s']:.1f} s "
                  f"-> cell timeout {grader.cell_timeout_for(lab, times)} s")
        print(f"wrote {grader.QUICK_TIMES}")
        return 0
    if args.submissions_dir is None:
        parser.error("give SUBMISSIONS_DIR (or --measure)")

    submissions = grader.find_submissions(args.submissions_dir)
    known = set(grader.discover_labs(args.source))
    skipped = sorted({lab for by_lab in submissions.values() for lab in by_lab if lab not in known})
    if skipped:
        print(f"skipping folders that are not labs: {', '.join(skipped)} (labs: {', '.join(sorted(known))})", file=sys.stderr)
    wanted = set(args.labs) if args.labs else known
    submissions = {s: {lab: p for lab, p in by_lab.items() if lab in wanted and lab in known} for s, by_lab in submissions.items()}
    submissions = {s: by_lab for s, by_lab in submissions.items() if by_lab}
    if not submissions:
        print(f"no submissions found under {args.submissions_dir} "
              "(expected <student_id>/<NN_topic>/<NN_topic>.ipynb)", file=sys.stderr)
        return 1
    count = sum(len(by_lab) for by_lab in submissions.values())
    jobs = args.jobs or grader.default_jobs()
    print(f"autograding {count} notebooks from {len(submissions)} students, {jobs} at a time; "
          "first the preflight: each lab's solution and untouched copy ...", flush=True)
    log_dir = args.out.with_name(args.out.stem + ".logs")
    try:
        rows = grader.autograde(submissions, source_dir=args.source, course_dir=args.keep, quick=not args.full,
                                cell_timeout_s=args.cell_timeout, feedback_dir=args.feedback, log_dir=log_dir,
                                progress=True, jobs=jobs, unsafe_no_sandbox=args.unsafe_no_sandbox,
                                similarity=args.similarity, out_csv=args.out, resume=args.resume)
    except sandbox.SandboxUnavailable as error:
        print(f"autograde: {error}", file=sys.stderr)
        return 2
    except grader.PreflightFailed as error:
        print(f"autograde: preflight failed, nothing graded: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"autograde: interrupted; the rows done are in {args.out}: rerun with --resume to grade the rest",
              file=sys.stderr)
        return 130
    print(grader.format_table(rows))
    print(grader.summary(rows))
    errors = sum(1 for row in rows if row["status"] == "error")
    print(f"wrote {args.out} ({len(rows)} rows), logs in {log_dir}/"
          + (f", feedback in {args.feedback}/" if args.feedback else ""))
    if errors:
        print(f"{errors} of {len(rows)} notebooks could not be graded (status error; see the reason column)",
              file=sys.stderr)
    return min(errors, 100)


if __name__ == "__main__":
    sys.exit(main())
