"""The course pipeline: masters -> labs/ + solutions/ (no drift), the nbgrader round trip
(solution = full marks, a cheating copy = 0, feedback without hidden tests), and every solution
runs headless."""

from __future__ import annotations

import html
import json
from pathlib import Path

import nbformat
import pytest

import cheats

from grading import build, grader

REPO_ROOT = build.REPO_ROOT
LABS = build.discover_labs()
MAX_NOTEBOOK_BYTES = 200_000
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
NOTEBOOK_TIMEOUT_S = 900


def committed_notebooks() -> list[Path]:
    paths = [*(REPO_ROOT / "labs").glob("*.ipynb"), *(REPO_ROOT / "solutions").glob("*.ipynb")]
    paths += (REPO_ROOT / "grading" / "source").glob("*/*.ipynb")
    return sorted(paths)


def test_there_are_labs():
    assert LABS, "no instructor masters found under grading/source/NN_topic/NN_topic.ipynb"


# --- build: one source of truth, deterministic output ---------------------------------------


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    """Every generated notebook, rendered once from the masters (nbgrader generate_assignment per lab)."""
    return build.render()


def test_committed_labs_and_solutions_match_their_masters(rendered):
    changed = build.build(REPO_ROOT, check=True, rendered=rendered)
    assert changed == [], f"labs/ or solutions/ drifted from grading/source; run `make labs`: {changed}"


def test_check_command_says_which_files_drifted(tmp_path, capsys, monkeypatch, rendered):
    monkeypatch.setattr(build, "render", lambda source_dir=build.SOURCE_DIR: rendered)  # rendered once above
    assert build.main(["--check"]) == 0 and "up to date" in capsys.readouterr().out
    assert build.main(["--check", "--out", str(tmp_path)]) == 1
    report = capsys.readouterr().out
    assert "run `make labs`" in report and f"labs/{LABS[0]}.ipynb" in report


def test_check_mode_lists_changed_and_stale_files_without_writing(tmp_path, rendered):
    assert build.build(tmp_path, rendered=rendered) == [f"labs/{lab}.ipynb" for lab in LABS] + [f"solutions/{lab}.ipynb" for lab in LABS]
    first_lab = tmp_path / "labs" / f"{LABS[0]}.ipynb"
    first_lab.write_text(first_lab.read_text() + " ")
    stale = tmp_path / "solutions" / "99_removed_lab.ipynb"
    stale.write_text("{}")
    unrelated = tmp_path / "labs" / "notes.ipynb"  # not NN_topic: not the build's business
    unrelated.write_text("{}")

    changed = build.build(tmp_path, check=True, rendered=rendered)

    assert changed == [f"labs/{LABS[0]}.ipynb", "solutions/99_removed_lab.ipynb"]
    assert first_lab.read_text().endswith(" ") and stale.exists(), "--check must not write"
    assert build.build(tmp_path, rendered=rendered) == changed and not stale.exists() and unrelated.exists()
    assert build.build(tmp_path, check=True, rendered=rendered) == []


# --- build checks on the masters (no nbgrader, no notebook execution) ---------------------------


def test_masters_pass_the_build_checks():
    build.check_masters(LABS)  # raises ValueError with the list of problems


@pytest.mark.parametrize(
    ("markdown", "lines"),
    [
        ("one H100 at 2.50 $/h", [1]),                                  # alone today, math once a second one comes
        ("0.55 $/Mtok\nand 2.50 $/h", [1, 2]),                          # a pair across lines is math too
        (r"0.55 \$/Mtok and 2.50 \$/h", [1, 1]),                        # marked turns \$ into a bare $ before MathJax
        (r"0.55 \\$/Mtok and **\\$ per million tokens**", []),          # the escape that stays a dollar
        ("$$t = \\max(a, b)$$\n\nand $$x^2$$", []),                     # display math, closed in its paragraph
        ("$$x\n\ny$$", [1, 3]),                                         # a blank line ends the paragraph: unclosed
        ("`$HOME`, ``a $ b`` and\n```bash\necho $PATH\n```", []),       # code spans and fenced code are literal
        ("~~~\ncost = $5\n~~~\n| stage | \\\\$ / Mtok |", []),
        ("5 $`code`", [1]),                                             # the $ just before a code span is prose
    ],
)
def test_markdown_check_reports_every_dollar_jupyterlab_could_typeset(markdown, lines):
    assert [line for line, _ in build.markdown_math_dollars(markdown)] == lines


def write_master(source_dir: Path, lab: str, cells: list) -> None:
    nb = nbformat.v4.new_notebook(cells=cells)
    (source_dir / lab).mkdir(parents=True)
    nbformat.write(nb, source_dir / lab / f"{lab}.ipynb")


def graded_cell(source: str, grade_id: str, cell_id: str):
    meta = {"nbgrader": {"grade": True, "grade_id": grade_id, "locked": True, "points": 1, "schema_version": 3,
                         "solution": False}}
    return nbformat.v4.new_code_cell(source, id=cell_id, metadata=meta)


def test_render_refuses_math_dollars_and_test_cells_without_an_assert(tmp_path, capsys):
    write_master(tmp_path, "98_broken", [
        nbformat.v4.new_markdown_cell("# Prices\n\nOne GPU at 2.50 $/h.", id="prices-md"),
        nbformat.v4.new_code_cell("from minillm.lab import lab00", id="imports"),
        graded_cell("lab00.check_e2e_latency(lambda ttft, tpot, n: ttft + tpot * (n - 1))", "test_helper_only", "t1"),
        graded_cell("### BEGIN HIDDEN TESTS\nassert 1 + 1 == 2\n### END HIDDEN TESTS", "test_hidden_assert_only", "t2"),
    ])
    with pytest.raises(ValueError) as failure:
        build.render(tmp_path)  # before nbgrader runs: the build fails fast, `make labs` and --check alike
    message = str(failure.value)
    assert "98_broken: markdown cell prices-md, line 3" in message and "One GPU at 2.50 $/h." in message
    assert "98_broken: test cell test_helper_only (cell t1) has no `assert`" in message
    assert "98_broken: test cell test_hidden_assert_only (cell t2) has no `assert`" in message
    assert build.main(["--check", "--source", str(tmp_path), "--out", str(tmp_path)]) == 1
    assert "98_broken: markdown cell prices-md, line 3" in capsys.readouterr().err


def test_test_cells_end_on_none_or_on_a_statement():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import textwrap\nfrom minillm.lab import lab05", id="imports"),
        graded_cell("assert True\nlab05.check_sequences_that_fit(lambda b, s, t: b // (s * t))", "ends_on_none", "a"),
        graded_cell("assert True\nprint('done')", "ends_on_print", "b"),
        graded_cell("x = 2\nassert x == 2", "ends_on_assert", "c"),
        graded_cell("assert True\n1 + 1", "ends_on_a_value", "d"),
        graded_cell("assert True\ntextwrap.dedent(' x')", "ends_on_unannotated", "e"),
        graded_cell("assert True\n### BEGIN HIDDEN TESTS\nundefined_helper()\n### END HIDDEN TESTS", "hidden_ends", "f"),
    ])
    problems = build.autograded_cell_problems("97_probe", nb)
    assert [p.split(" (cell ")[0] for p in problems] == [
        "97_probe: test cell ends_on_a_value", "97_probe: test cell ends_on_unannotated", "97_probe: test cell hidden_ends",
    ], problems
    assert "`1 + 1`, whose value nbgrader would read as a partial score" in problems[0]
    assert "textwrap.dedent is not annotated `-> None`" in problems[1]
    assert "with the hidden tests: it ends on `undefined_helper()`" in problems[2]


def test_every_check_helper_returns_none():
    """nbgrader reads the value a test cell ends on as a partial score: every labNN.check_* prints its
    verdict and is annotated -> None (the build check above relies on the annotation)."""
    import importlib
    import inspect

    for lab in LABS:
        module = importlib.import_module(f"minillm.lab.lab{lab[:2]}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("check_") and fn.__module__ == module.__name__:
                assert inspect.signature(fn).return_annotation in (None, "None"), f"{module.__name__}.{name}"


@pytest.mark.parametrize("lab", LABS)
def test_student_copy_has_no_solutions_hidden_tests_or_outputs(lab):
    student = nbformat.read(REPO_ROOT / "labs" / f"{lab}.ipynb", as_version=4)
    solution = nbformat.read(REPO_ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    nbformat.validate(student)
    nbformat.validate(solution)
    for nb in (student, solution):
        text = json.dumps(nb)
        for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
            assert marker not in text, f"{lab}: '{marker}' left in a generated notebook"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{lab}: cell {cell.id} has outputs"
    assert any(c.metadata.get("nbgrader", {}).get("solution") for c in student.cells), f"{lab}: no exercise"
    assert any(c.metadata.get("nbgrader", {}).get("grade") for c in student.cells), f"{lab}: no graded test"
    assert "raise NotImplementedError()" in json.dumps(student), f"{lab}: solution stubs missing"


@pytest.mark.parametrize("path", committed_notebooks(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_committed_notebook_is_small_and_carries_no_widget_state(path):
    size_bytes = path.stat().st_size
    assert size_bytes < MAX_NOTEBOOK_BYTES, (
        f"{path.name} is {size_bytes / 1e3:.0f} kB (limit {MAX_NOTEBOOK_BYTES / 1e3:.0f} kB): clear its outputs"
    )
    nb = nbformat.read(path, as_version=4)
    assert "widgets" not in nb.metadata and WIDGET_STATE_MIME not in path.read_text(encoding="utf-8"), (
        f"{path.name} carries saved widget state: clear it (the build strips it from labs/ and solutions/)"
    )


# --- nbgrader round trip -----------------------------------------------------------------------


# Labs whose cheating copy is graded in make test; the others' run in the slow suite (the static
# test_a_cheating_copy_runs_the_masters_cells_and_its_own_solution_cells_only covers every lab in make test).
CHEAT_RUN_IN_MAKE_TEST = {"00_setup", "01_prefill_decode", "02_kv_cache", "03_batching", "04_paged_attention"}


def _grade(lab: str, folder: Path, students: dict[str, Path]) -> dict[str, dict]:
    # No preflight: these tests grade the lab's solution themselves (and its cheating copy, the untouched one
    # with every cheat), which is what the preflight checks (tests/test_grading_class.py runs it).
    rows = grader.autograde({name: {lab: path} for name, path in students.items()},
                            feedback_dir=folder / "feedback", log_dir=folder / "logs", preflight=False)
    return {row["student"]: row for row in rows}


def _cheat_path(lab: str, folder: Path) -> Path:
    path = folder / "cheat" / lab / f"{lab}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(cheats.cheating_copy(lab, folder / "cheated", f"minillm-cheat-{lab}"), path)
    return path


@pytest.fixture(scope="module", params=LABS)
def graded_lab(request, tmp_path_factory):
    """Autograde the committed solution of one lab and (labs in CHEAT_RUN_IN_MAKE_TEST) its
    cheating copy: the untouched student copy with every cheat of tests/cheats.py. One
    run each; feedback and logs written."""
    lab = request.param
    folder = tmp_path_factory.mktemp(f"graded-{lab}")
    students = {"solution": REPO_ROOT / "solutions" / f"{lab}.ipynb"}
    if lab in CHEAT_RUN_IN_MAKE_TEST:
        students["cheat"] = _cheat_path(lab, folder)
    return lab, _grade(lab, folder, students), folder


def test_solution_gets_full_marks_and_runs_without_errors(graded_lab):
    """The graded run executes the whole solution headless (nbclient, MINILLM_QUICK=1) with the
    hidden tests restored, the solution cells in the sandbox: every cell must run clean, every test pass."""
    lab, rows, folder = graded_lab
    row = rows["solution"]
    assert row["status"] == "graded" and row["reason"] == "", row["reason"]
    assert row["max_score"] > 0, f"{lab} has no points to grade"
    autograded_max = row["max_score"] - row["manual_max_score"]  # a write-up's points wait for the instructor
    assert autograded_max > 0, f"{lab} has no autograded points"
    assert row["score"] == autograded_max, f"{lab} solution scored {row['score']}/{autograded_max}: {row['failures']}"
    assert not row["errors"], f"{lab} solution raised in cells: {row['errors']}"
    log = (folder / "logs" / "solution" / f"{lab}.log").read_text(encoding="utf-8")
    assert "checksum" not in log, f"{lab}: nbgrader logged a checksum change for the untouched test cells"


def _assert_cheat_scores_zero(lab: str, row: dict, max_score: float, folder: Path) -> None:
    assert row["status"] == "graded"
    assert row["max_score"] == max_score
    assert row["score"] == 0, f"{lab}: the cheating copy scored {row['score']} (a test passes without work): {row['reason']}"
    assert not (folder / "cheated").exists(), f"{lab}: a cheat reached outside the sandbox: {(folder / 'cheated').read_text()}"
    assert not (REPO_ROOT / "SANDBOX_ESCAPED").exists()
    if cheats.REFERENCE_CHEATS.get(lab):  # the reference cheats ran, and were refused
        assert "(unavailable in the sandbox)" in row["reason"], f"{lab}: no reference was refused: {row['reason']}"


def test_cheating_copy_gets_zero(graded_lab):
    """Every class of cheat in every solution cell (tests/cheats.py: evasions, IPython hooks, spoofed
    provenance, the course and the gradebook, detached processes, grading detected, the lab's own
    references called in place of the work) and in extra cells: 0 points, nothing reached outside."""
    lab, rows, folder = graded_lab
    if "cheat" not in rows:
        pytest.skip(f"{lab}'s cheating copy runs in make test-slow (test_cheating_copy_gets_zero_on_the_slow_labs)")
    _assert_cheat_scores_zero(lab, rows["cheat"], rows["solution"]["max_score"], folder)


@pytest.mark.slow
@pytest.mark.parametrize("lab", [lab for lab in LABS if lab not in CHEAT_RUN_IN_MAKE_TEST])
def test_cheating_copy_gets_zero_on_the_slow_labs(lab, tmp_path):
    rows = _grade(lab, tmp_path, {"cheat": _cheat_path(lab, tmp_path)})
    max_score = sum(float(c.metadata["nbgrader"].get("points", 0)) for c in build.read_master(lab).cells
                    if c.metadata.get("nbgrader", {}).get("grade"))
    _assert_cheat_scores_zero(lab, rows["cheat"], max_score, tmp_path)
    page = (tmp_path / "feedback" / "cheat" / lab / f"{lab}.html").read_text(encoding="utf-8")
    assert "HIDDEN TESTS" not in page


def test_feedback_shows_scores_and_no_hidden_test(graded_lab):
    lab, rows, folder = graded_lab
    master = build.read_master(lab)
    hidden = grader.LabCourse(lab, master, {c.metadata["nbgrader"]["grade_id"]: (c.source, "") for c in master.cells
                                             if c.metadata.get("nbgrader", {}).get("grade")}, {}).hidden_lines()
    assert hidden, f"{lab} has no hidden tests"
    for student, row in rows.items():
        page = html.unescape((folder / "feedback" / student / lab / f"{lab}.html").read_text(encoding="utf-8"))
        assert f"{row['score']:g} / {row['max_score']:g}" in page
        leaked = [line for line in hidden if len(line) >= 12 and line in page]
        assert not leaked and "HIDDEN TESTS" not in page, f"{lab} feedback of {student} shows hidden tests: {leaked[:3]}"


def test_autograde_refuses_unknown_labs(tmp_path):
    with pytest.raises(ValueError, match="no master for lab"):
        grader.autograde({"ada": {"77_nope": tmp_path / "77_nope.ipynb"}})


def test_find_submissions_reads_the_documented_layout(tmp_path):
    for student, lab in [("ada", "01_prefill_decode"), ("ada", "02_kv_cache"), ("grace", "01_prefill_decode")]:
        (tmp_path / student / lab).mkdir(parents=True)
        (tmp_path / student / lab / f"{lab}.ipynb").write_text("{}")
    (tmp_path / "grace" / "01_prefill_decode" / "scratch.ipynb").write_text("{}")
    found = grader.find_submissions(tmp_path)
    assert {s: sorted(by_lab) for s, by_lab in found.items()} == {
        "ada": ["01_prefill_decode", "02_kv_cache"],
        "grace": ["01_prefill_decode"],
    }


# --- every solution runs top to bottom ------------------------------------------------------------


@pytest.mark.slow  # the graded run above already executes each solution with nbclient
@pytest.mark.parametrize("lab", LABS)
def test_solution_notebook_executes_headless_in_quick_mode(lab, tmp_path, monkeypatch):
    """Plain nbclient, no nbgrader: stops at the first failing cell with its traceback."""
    from nbclient import NotebookClient

    monkeypatch.setenv("MINILLM_QUICK", "1")  # the kernel inherits this process's environment
    nb = nbformat.read(REPO_ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    client = NotebookClient(
        nb,
        timeout=NOTEBOOK_TIMEOUT_S,
        startup_timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # files a lab writes land in tmp
    )
    client.execute()  # raises CellExecutionError naming the cell and its traceback
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
