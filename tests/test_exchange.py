"""The instructor loop of nbgrader's exchange on one machine, as a class on JupyterHub runs it
(grading/README.md, "A class on JupyterHub"): release, two students fetch and submit, collect,
autograde with the project's grader, release feedback, each student fetches their own.

Every nbgrader step is its own `python -m nbgrader` process, as a person would type it:
- the "global" config (/etc/jupyter/nbgrader_config.py on a hub) sits in a shared folder on
  JUPYTER_CONFIG_PATH and sets Exchange.root and the course id;
- the instructor runs in the course directory (its nbgrader_config.py, from make_course);
- each student has a home (HOME, ~/.jupyter, the nbgrader cache in ~/.local/share/jupyter) and a
  working folder. nbgrader 0.9.6 names the user with pwd.getpwuid(os.getuid()) (the USER variable is
  not read; a "jovyan" account reads JUPYTERHUB_USER instead), so on one account the students say
  who they are with `--student`, the documented alias of CourseDirectory.student_id.
"""

from __future__ import annotations

import hashlib
import html
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lab_utils import PROBE_LAB, write_probe_master

from grading import grader
from grading.build import generate_assignments, make_course

COURSE_ID = "minillm"  # as in grading/nbgrader_config.py
HIDDEN_TEST_LINE = "assert double(-3) == -6"
STEP_TIMEOUT_S = 300


def _env(home: Path, global_config_dir: Path) -> dict[str, str]:
    """The environment of one user's nbgrader process: their own home and Jupyter folders, the shared
    global config, and the venv's scripts on PATH (creating a gradebook shells out to alembic)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        JUPYTER_CONFIG_DIR=str(home / ".jupyter"),
        JUPYTER_DATA_DIR=str(home / ".local" / "share" / "jupyter"),
        JUPYTER_CONFIG_PATH=str(global_config_dir),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    return env


def nbgrader(*args: str, cwd: Path, env: dict[str, str]) -> str:
    """Run `python -m nbgrader ARGS` in cwd; return its log (nbgrader logs to stderr); fail with it."""
    result = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=STEP_TIMEOUT_S,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"nbgrader {' '.join(args)} failed (exit {result.returncode}):\n{log}"
    return log


def _text(page: str) -> str:
    """The text of an HTML page: tags dropped (syntax highlighting splits code into spans), entities
    decoded, whitespace collapsed."""
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", page)))


@pytest.mark.slow  # 81 s on 2 busy cores: ten nbgrader processes (4 s of imports each) and one graded run
def test_release_fetch_submit_collect_grade_and_return_feedback(tmp_path):
    # --- the machine: a shared exchange and a global config every account reads
    exchange = tmp_path / "srv" / "nbgrader" / "exchange"
    exchange.mkdir(parents=True)
    exchange.chmod(0o1777)  # everyone writes, nobody deletes another's files
    global_config_dir = tmp_path / "etc" / "jupyter"
    global_config_dir.mkdir(parents=True)
    (global_config_dir / "nbgrader_config.py").write_text(
        f"c = get_config()  # noqa: F821\nc.Exchange.root = {str(exchange)!r}\n"
        f"c.CourseDirectory.course_id = {COURSE_ID!r}\n"
    )

    # --- the instructor's course directory, from the probe master
    source_dir = tmp_path / "masters"
    write_probe_master(source_dir)
    course = make_course(tmp_path / "instructor" / "course", [PROBE_LAB], source_dir)
    generate_assignments(course, [PROBE_LAB])
    instructor = _env(tmp_path / "instructor", global_config_dir)

    nbgrader("release_assignment", PROBE_LAB, cwd=course, env=instructor)
    assert (exchange / COURSE_ID / "outbound" / PROBE_LAB / f"{PROBE_LAB}.ipynb").is_file()
    assert stat.S_IMODE(exchange.stat().st_mode) == 0o1777, "release_assignment changed the exchange's mode"

    # --- two students: fetch, work (or not), submit
    students = {"ada": True, "grace": False}  # student -> solves the exercise
    workdirs, envs = {}, {}
    for student, solves in students.items():
        envs[student] = _env(tmp_path / "home" / student, global_config_dir)
        workdirs[student] = tmp_path / "home" / student / "work"
        workdirs[student].mkdir()
        nbgrader("fetch_assignment", PROBE_LAB, "--course", COURSE_ID, cwd=workdirs[student], env=envs[student])
        notebook_path = workdirs[student] / PROBE_LAB / f"{PROBE_LAB}.ipynb"
        nb = nbformat.read(notebook_path, as_version=4)
        assert HIDDEN_TEST_LINE not in nbformat.writes(nb), "a hidden test reached the released notebook"
        if solves:
            exercise = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "double")
            assert "raise NotImplementedError()" in exercise.source
            exercise.source = "def double(x):\n    return 2 * x"
            nbformat.write(nb, notebook_path)
        nbgrader("submit", PROBE_LAB, "--course", COURSE_ID, "--student", student, cwd=workdirs[student], env=envs[student])

    # --- the instructor collects and grades
    nbgrader("collect", PROBE_LAB, cwd=course, env=instructor)
    submitted = course / "submitted"
    found = grader.find_submissions(submitted)
    assert {s: sorted(by_lab) for s, by_lab in found.items()} == {s: [PROBE_LAB] for s in students}
    for student in students:  # what submit wrote next to the notebook, and release_feedback reads back
        assert {p.name for p in (submitted / student / PROBE_LAB).iterdir()} == {
            f"{PROBE_LAB}.ipynb", "timestamp.txt", "submission_secret.txt"}

    feedback_dir = course / "feedback"
    rows = grader.autograde(found, source_dir=source_dir, quick=True, feedback_dir=feedback_dir)
    scores = {row["student"]: (row["score"], row["max_score"]) for row in rows}
    assert scores == {"ada": (4.0, 4.0), "grace": (0.0, 4.0)}, rows

    # --- return feedback. release_feedback reads, beside each feedback/<student>/<lab>/<lab>.html, the
    # submission's timestamp.txt (logged) and submission_secret.txt (the exchange names the file
    # md5(secret + "<lab>").html; fetch_feedback recomputes it from the student's cached copy of the secret).
    for student in students:
        for name in ("timestamp.txt", "submission_secret.txt"):
            expected = (submitted / student / PROBE_LAB / name).read_text()
            given = feedback_dir / student / PROBE_LAB / name
            assert given.is_file() and given.read_text() == expected, (
                f"the grader must copy {name} from submitted/{student}/{PROBE_LAB}/ beside the feedback HTML")
    nbgrader("release_feedback", PROBE_LAB, cwd=course, env=instructor)
    secrets = {student: (submitted / student / PROBE_LAB / "submission_secret.txt").read_text() for student in students}
    released = {path.name for path in (exchange / COURSE_ID / "feedback").iterdir()}
    assert released == {hashlib.md5((secret + PROBE_LAB).encode()).hexdigest() + ".html" for secret in secrets.values()}

    for student in students:
        nbgrader("fetch_feedback", PROBE_LAB, "--course", COURSE_ID, "--student", student,
                 cwd=workdirs[student], env=envs[student])
        timestamp = (submitted / student / PROBE_LAB / "timestamp.txt").read_text()
        fetched = sorted((workdirs[student] / PROBE_LAB / "feedback").rglob("*"))
        fetched_files = [p for p in fetched if p.is_file()]
        assert fetched_files == [workdirs[student] / PROBE_LAB / "feedback" / timestamp / f"{PROBE_LAB}.html"], fetched
        page = fetched_files[0].read_text(encoding="utf-8")
        assert page == (feedback_dir / student / PROBE_LAB / f"{PROBE_LAB}.html").read_text(encoding="utf-8"), (
            f"{student} fetched feedback that is not theirs")
        text = _text(page)
        score, max_score = scores[student]
        assert re.search(rf"(?<![\d.]){score:g}(?:\.0+)?\s*/\s*{max_score:g}(?:\.0+)?(?![\d.])", text), (
            f"{student}'s feedback does not show the score {score:g} / {max_score:g}")
        compact = text.replace(" ", "")
        assert HIDDEN_TEST_LINE.replace(" ", "") not in compact and "HIDDENTESTS" not in compact, (
            f"{student}'s feedback shows a hidden test")



@pytest.mark.skipif(not hasattr(os, "chown") or os.geteuid() != 0, reason="needs root to give a file to another account")
def test_collect_refuses_a_submission_made_by_another_account_or_holding_a_link(tmp_path):
    """grading/course.py: a submission is collected only when it and all it holds belong to the student it names
    (tests/test_hub.py runs the whole impostor case on a hub with real accounts)."""
    import pwd

    from grading.course import refusal

    nobody = pwd.getpwnam("nobody")
    folder = tmp_path / "inbound" / "grace+02_kv_cache+2026-12-07 10:00:00.000000 UTC+abc"
    folder.mkdir(parents=True)
    (folder / "02_kv_cache.ipynb").write_text("{}", encoding="utf-8")
    os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    assert refusal(str(folder), "grace") == "it claims to be submitted by grace but was made by nobody"
    os.chown(folder, 0, 0)
    assert refusal(str(folder), "grace") is None          # the collecting account (here root) may have made it
    os.chown(folder / "02_kv_cache.ipynb", nobody.pw_uid, nobody.pw_gid)
    assert refusal(str(folder), "grace") == "it claims to be submitted by grace but its file 02_kv_cache.ipynb belongs to nobody"
    os.chown(folder / "02_kv_cache.ipynb", 0, 0)
    (folder / "master.ipynb").symlink_to("/etc/passwd")
    assert refusal(str(folder), "grace") == "it claims to be submitted by grace but holds a symbolic link, master.ipynb -> /etc/passwd"
