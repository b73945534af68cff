"""How long a lab takes: the full-mode compute measured on this machine, plus reading and writing estimated.

    python -m grading.timing --measure 03_batching     # run the solution in full mode, record grading/full_times.json
    python -m grading.timing                           # the table: compute + reading + writing against cell 0's time

A learner's time on a lab is three parts, each counted from the lab itself:

- **compute**: the solution notebook run top to bottom in full mode (``MINILLM_QUICK`` unset), measured here
  with nbclient and kept in ``grading/full_times.json`` with the machine it ran on;
- **reading**: the words of every markdown cell and every code cell the learner runs but does not write, at
  ``READING_WPM`` (technical prose is read slower than a novel's ~250);
- **writing**: the lines the learner writes (between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` of the
  solution code cells, blank lines and comments left out) at ``MINUTES_PER_LINE`` each, which covers reading the
  spec again, typing, running the check and fixing what it says.

The header's ``**Time:** about N minutes`` must lie within ``TOLERANCE`` of their sum; ``grading.report`` (``make
labs-report``) prints the parts and flags a header that does not.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from pathlib import Path

from grading.build import REPO_ROOT, SOURCE_DIR, discover_labs, read_master

FULL_TIMES = Path(__file__).with_name("full_times.json")
READING_WPM = 180
MINUTES_PER_LINE = 1.5
TOLERANCE = 0.20
STATED = re.compile(r"\*\*Time:\*\*\s*about\s+(\d+)\s*minutes")
WORD = re.compile(r"[A-Za-z0-9_]+")


def _nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def lines_to_write(nb) -> int:
    """Lines of code inside the solution regions of the master's solution code cells (no blanks, no comments)."""
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code" or not _nbgrader(cell).get("solution"):
            continue
        inside = False
        for line in cell.source.splitlines():
            text = line.strip()
            if text.startswith("### BEGIN SOLUTION"):
                inside = True
            elif text.startswith("### END SOLUTION"):
                inside = False
            elif inside and text and not text.startswith("#"):
                count += 1
    return count


def words_to_read(nb) -> int:
    """Words of the markdown cells and of the code cells the learner only runs (not the solutions, not the
    tests' hidden parts, not the mark schemes)."""
    total = 0
    for cell in nb.cells:
        meta = _nbgrader(cell)
        if cell.cell_type == "code" and (meta.get("solution") or meta.get("grade")):
            continue
        source = re.sub(r"### BEGIN MARK SCHEME.*?### END MARK SCHEME", "", cell.source, flags=re.S)
        total += len(WORD.findall(source))
    return total


def stated_minutes(nb) -> int | None:
    """The ``**Time:** about N minutes`` of the header (cell 0), or None."""
    match = STATED.search(nb.cells[0].source if nb.cells else "")
    return int(match.group(1)) if match else None


def full_times(path: Path = FULL_TIMES) -> dict[str, dict]:
    return json.loads(path.read_text()) if path.exists() else {}


def estimate(lab: str, source_dir: Path = SOURCE_DIR, times: dict | None = None) -> dict:
    """``{compute_min, reading_min, writing_min, lines, words, total_min, stated_min, measured_on}`` of one lab;
    compute_min and total_min are None while the lab's full run was never measured."""
    nb = read_master(lab, source_dir)
    entry = (full_times() if times is None else times).get(lab)
    lines, words = lines_to_write(nb), words_to_read(nb)
    compute = entry["full_s"] / 60 if entry else None
    reading, writing = words / READING_WPM, lines * MINUTES_PER_LINE
    return {"lab": lab, "compute_min": compute, "reading_min": reading, "writing_min": writing, "lines": lines,
            "words": words, "total_min": None if compute is None else compute + reading + writing,
            "stated_min": stated_minutes(nb), "measured_on": entry.get("measured_on") if entry else None}


def problems(row: dict) -> list[str]:
    lab = row["lab"]
    if row["stated_min"] is None:
        return [f"{lab}: the header states no time ('**Time:** about N minutes')"]
    if row["total_min"] is None:
        return [f"{lab}: its full-mode compute time was never measured (python -m grading.timing --measure {lab})"]
    low, high = row["total_min"] * (1 - TOLERANCE), row["total_min"] * (1 + TOLERANCE)
    if not low <= row["stated_min"] <= high:
        return [f"{lab}: the header says about {row['stated_min']} minutes; compute + reading + writing is "
                f"{row['total_min']:.0f} min (state {low:.0f}-{high:.0f})"]
    return []


def format_table(rows: list[dict]) -> str:
    head = f"{'lab':<26}{'compute':>8}{'reading':>8}{'writing':>8}{'lines':>6}{'total':>7}{'stated':>7}  measured on"
    out = [head, "-" * len(head)]
    for r in rows:
        compute = "-" if r["compute_min"] is None else f"{r['compute_min']:.0f}"
        total = "-" if r["total_min"] is None else f"{r['total_min']:.0f}"
        out.append(f"{r['lab']:<26}{compute:>8}{r['reading_min']:>8.0f}{r['writing_min']:>8.0f}{r['lines']:>6}"
                   f"{total:>7}{r['stated_min'] or '-':>7}  {r['measured_on'] or '-'}")
    out.append(f"minutes; reading at {READING_WPM} words/min, writing at {MINUTES_PER_LINE} min per solution line; "
               f"the header's time must be within {TOLERANCE:.0%} of the total")
    return "\n".join(out)


def machine() -> str:
    from minillm.hardware import device_name

    return f"{device_name('cpu')}, {os.cpu_count()} cores"


FULL_RUNS = REPO_ROOT / "artifacts" / "full-runs"


def measure_full(lab: str, solutions_dir: Path | None = None, timeout_s: int = 7200, keep: Path | None = FULL_RUNS) -> float:
    """Run the lab's solution notebook top to bottom in full mode in a scratch folder; seconds it took. The run,
    outputs included, is kept as `keep`/<lab>.ipynb (its printed numbers are the labs' reference numbers)."""
    import tempfile

    import nbformat
    from nbclient import NotebookClient

    solutions_dir = REPO_ROOT / "solutions" if solutions_dir is None else Path(solutions_dir)
    nb = nbformat.read(solutions_dir / f"{lab}.ipynb", as_version=4)
    saved = os.environ.pop("MINILLM_QUICK", None)
    try:
        with tempfile.TemporaryDirectory(prefix=f"full-{lab}-") as scratch:
            client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": scratch}})
            start = time.perf_counter()
            client.execute()
            seconds = time.perf_counter() - start
        if keep is not None:
            Path(keep).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, Path(keep) / f"{lab}.ipynb")
        return seconds
    finally:
        if saved is not None:
            os.environ["MINILLM_QUICK"] = saved


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grading.timing", description=__doc__.split("\n")[0])
    parser.add_argument("labs", nargs="*", help="only these labs (default: every master)")
    parser.add_argument("--measure", action="store_true", help="run the labs' solutions in full mode and record it")
    args = parser.parse_args(argv)
    labs = args.labs or discover_labs(SOURCE_DIR)
    if args.measure:
        times = full_times()
        for lab in labs:
            print(f"{lab}: running the solution in full mode ...", flush=True)
            seconds = measure_full(lab)
            times[lab] = {"full_s": round(seconds, 1), "measured_on": machine()}
            FULL_TIMES.write_text(json.dumps(dict(sorted(times.items())), indent=1) + "\n")
            print(f"{lab}: {seconds / 60:.1f} min", flush=True)
    rows = [estimate(lab) for lab in labs]
    print(format_table(rows))
    found = [p for row in rows for p in problems(row)]
    for problem in found:
        print(f"  {problem}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
