"""Feedback a student may read: scores, failing tests and what may be shown of them, no hidden test.

``nbgrader generate_feedback`` renders the autograded notebook, and with it the hidden tests the
grader put back, word for word. This page is built from the grades instead: one line per graded
cell (points, passed or the failure's message), the row's notes, and none of the tests' source.

A message is shown only where it cannot carry a hidden test's inputs: a failure inside a hidden test
shows only its error type; so does any failure after the first hidden test ran (the submission's code
saw that test's inputs and may quote them in what it returns or raises later); a message that quotes a
line of a hidden test is withheld. Every message is cut to its first line, 300 characters at most. The
instructor's log keeps everything. The file lands at ``<feedback_dir>/<student>/<lab>/<lab>.html``, the
layout of nbgrader's feedback folder, so ``nbgrader release_feedback`` can hand it out.
"""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import nbformat

from grading.build import COURSE_ID, hidden_line_numbers

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
CELL_LINE = re.compile(r"(?:Cell In\s*\[\d*\]|<ipython-input-[^>]*>|/tmp/ipykernel_\d+/\d+\.py)\D{0,12}?(\d+)")
WITHHELD = "(message withheld: it quotes a hidden test)"
AFTER_HIDDEN = "(message withheld: hidden tests had run before it; the visible test in your notebook shows it)"
MESSAGE_CHARS = 300


def first_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    line = "".join(ch if ch.isprintable() else "?" for ch in line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _failing_line(output: dict) -> int | None:
    match = CELL_LINE.search(ANSI.sub("", "\n".join(output.get("traceback", []))))
    return int(match.group(1)) if match else None


def failure_messages(autograded: Path, lab_course, zeroed: dict | None = None) -> dict[str, str]:
    """``{test grade_id: what a student may read of its failure}`` for each graded test cell that raised.
    Tests run in notebook order; once a hidden part has run, no message is shown (its type only)."""
    nb = nbformat.read(autograded, as_version=4) if Path(autograded).is_file() else None
    hidden_lines = lab_course.hidden_lines()
    messages, hidden_ran = {}, False
    for cell in (nb.cells if nb is not None else []):
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
            continue
        name = meta.get("grade_id", "")
        source = lab_course.sources.get(name, (cell.source, ""))[0]
        hidden = hidden_line_numbers(source)
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        stderr = [o for o in cell.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stderr"]
        if name in (zeroed or {}):
            messages[name] = f"0 points: {zeroed[name]}"
        elif errors:
            line = _failing_line(errors[-1])
            safe = not hidden_ran and (line is None and not hidden or line is not None and (not hidden or line < min(hidden)))
            ename = first_line(errors[-1].get("ename", "Error"), 80)
            if line is not None and line in hidden:
                messages[name] = f"a hidden test failed ({ename})"
            elif not safe:
                messages[name] = f"{ename} {AFTER_HIDDEN}" if str(errors[-1].get("evalue", "")).strip() else ename
            else:
                messages[name] = first_line(visible_message(errors[-1], source, hidden_lines))
        elif stderr:
            messages[name] = "the cell wrote to stderr (a warning counts as a failure)"
        if hidden:
            hidden_ran = True
    return messages


def visible_message(output: dict, source: str, hidden_lines: list[str]) -> str:
    """What a student may see of one error output of a test cell whose executed source is ``source``."""
    ename, evalue = output.get("ename", "Error"), str(output.get("evalue", ""))
    traceback = ANSI.sub("", "\n".join(output.get("traceback", [])))
    match = CELL_LINE.search(traceback)
    if match and int(match.group(1)) in hidden_line_numbers(source):
        return f"a hidden test failed ({ename})"
    if any(line in evalue for line in hidden_lines if len(line) >= 6):
        return f"{ename}: {WITHHELD}"
    return f"{ename}: {evalue}" if evalue else ename


def render(row: dict, cells: list[dict]) -> str:
    """The feedback page of one row; ``cells``: ``{"name", "score", "max_score", "result"}``."""
    title = f"{row['lab']} — {row['student']}"
    if row["status"] != "graded":
        summary = f"<p class='failed'>Not graded: {html.escape(row['reason'])}</p>"
    else:
        manual = row.get("manual_max_score") or 0.0
        summary = (f"<p class='score'>Score: <b>{row['score']:g} / {row['max_score']:g}</b>"
                   + (f" ({manual:g} of them graded by hand, not yet counted)" if manual else "") + "</p>")
        notes = row.get("reason_general", row.get("reason", ""))
        if notes:
            summary += f"<p class='reason'>Notes from the grader: {html.escape(notes)}</p>"
    body = "".join(
        f"<tr class='{'pass' if cell['result'] == 'passed' else 'fail'}'><td>{html.escape(cell['name'])}</td>"
        f"<td>{cell['score']:g} / {cell['max_score']:g}</td><td>{html.escape(cell['result'])}</td></tr>"
        for cell in cells
    )
    table = ("<table><thead><tr><th>test</th><th>points</th><th>result</th></tr></thead>"
             f"<tbody>{body}</tbody></table>") if cells else ""
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}tr.fail td{background:#fdecea}"
             "tr.pass td{background:#eaf7ea}.failed{color:#b00}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{summary}{table}</body></html>\n")


def cell_results(row: dict, course_root: Path, lab_course) -> list[dict]:
    """Per graded cell of a graded row: points from the gradebook, the visible result."""
    from nbgrader.api import Gradebook, MissingEntry

    lab, student = row["lab"], row["student"]
    autograded = course_root / "autograded" / student / lab / f"{lab}.ipynb"
    nb = nbformat.read(autograded, as_version=4) if autograded.is_file() else None
    messages = failure_messages(autograded, lab_course, row.get("zeroed", {}))
    results = []
    with Gradebook("sqlite:///" + str(course_root / "gradebook.db"), COURSE_ID) as gradebook:
        for cell in (nb.cells if nb is not None else []):
            meta = cell.metadata.get("nbgrader", {})
            if not meta.get("grade"):
                continue
            name = meta["grade_id"]
            try:
                grade = gradebook.find_grade(name, lab, lab, student)
                score, max_score = float(grade.score or 0.0), float(grade.max_score)
            except MissingEntry:
                grade, score, max_score = None, 0.0, float(meta.get("points", 0))
            if name in row.get("zeroed", {}):
                result = f"0 points: {row['zeroed'][name]}"
            elif cell.cell_type == "markdown" or meta.get("solution"):
                result = "graded by hand" if grade is not None and grade.manual_score is not None else "waits for the instructor"
            else:
                result = f"failed: {messages[name]}" if name in messages else "passed"
            results.append({"name": name, "score": score, "max_score": max_score, "result": result})
    return results


def write(row: dict, course_root: Path, lab_course, feedback_dir: Path) -> Path:
    """Write the feedback page of one row to ``feedback_dir/<student>/<lab>/<lab>.html``; return it.
    nbgrader's timestamp.txt and submission_secret.txt go beside it when the submission had them
    (``nbgrader release_feedback`` names the page from the secret and fails without either)."""
    lab, student = row["lab"], row["student"]
    folder = Path(feedback_dir) / student / lab
    folder.mkdir(parents=True, exist_ok=True)
    cells = cell_results(row, Path(course_root), lab_course) if row["status"] == "graded" else []
    path = folder / f"{lab}.html"
    path.write_text(render(row, cells), encoding="utf-8")
    submitted = row.get("submitted_dir")
    for name in ("timestamp.txt", "submission_secret.txt"):  # nbgrader release_feedback needs both
        if submitted and (Path(submitted) / name).is_file():
            shutil.copyfile(Path(submitted) / name, folder / name)
    return path
