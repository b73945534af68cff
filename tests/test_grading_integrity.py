"""The grader's defences, without running a notebook: the screen of solution cells, the runtime
guard in an IPython shell, the graded copy built from a submission, the feedback page.

The round trips that execute real submissions live in tests/test_grading.py and tests/test_course.py.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from lab_utils import cheating_copy

from grading import build, feedback, grader, screen

REPO_ROOT = Path(__file__).resolve().parents[1]
LABS = build.discover_labs()

# Every cheat of the class: code that changes how later cells run or what the checks see.
CHEATS = {
    "input transformer": "ip = get_ipython()\nip.input_transformers_post.append(lambda lines: ['try:\\n'] + lines)",
    "ast transformer": "get_ipython().ast_transformers.append(object())",
    "patched helper": "lab02.check_in_engine = lambda *a, **k: None",
    "patched helper via setattr": "setattr(lab02, 'check_in_engine', print)",
    "patched check function": "torch.allclose = lambda *a, **k: True",
    "patched math": "math.isclose = lambda *a, **k: True",
    "tracer": "import sys\nsys.settrace(lambda *a: None)",
    "tracer from a function": "def double(x):\n    import sys\n    sys.settrace(None)\n    return 2 * x",
    "patched builtin": "import builtins\nbuiltins.isinstance = lambda *a: True",
    "rebound builtin": "def isinstance(*args):\n    return True",
    "rebound exception": "AssertionError = Exception",
    "dunder route": "().__class__.__base__.__subclasses__()",
    "globals route": "globals()['lab02'] = None",
    "exec route": "exec('import sys')",
    "import route": "__import__('sys').settrace(None)",
    "importlib": "import importlib\nimportlib.import_module('sys')",
    "kernel exit": "import os\nos._exit(0)",
    "environment": "import os\nos.environ['MINILLM_QUICK'] = '0'",
    "object equal to anything": "class Yes:\n    def __eq__(self, other):\n        return True\nanswer = Yes()",
    "float that lies": "class Liar(float):\n    def __float__(self):\n        return 1.0",
    "shadowed test input": "llm = None",
    "shadowed module": "torch = None",
    "global rebinding": "def f():\n    global llm\n    llm = None",
    "magic": "%time 1",
    "shell escape": "!rm -rf /",
    "custom exception handler": "get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)",
    "torch function mode": "import torch.overrides\nclass M(torch.overrides.TorchFunctionMode):\n    pass",
    "open a file": "open('grades.csv', 'w')",
    "module dict write": "lab02.__dict__['check_in_engine'] = print",
    "metaclass": "class A(metaclass=type):\n    pass",
    "patched test input": "llm.tokenizer.encode = lambda text: [0]",
    "rewritten measurement": "decode['ttft_s'] = 0.0",
    "patched test input from a function": "def double(x):\n    llm.tokenizer = None\n    return 2 * x",
    "the grader's guard": "from grading import guard\nguard.verify(None)",
    "the grader's guard by its path": "import grading.guard as g",
}
PROTECTED = {"llm", "torch", "math", "lab02", "np", "decode"}
MODULES = {"torch", "math", "lab02", "np"}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_screen_refuses_every_cheat_of_the_class(name):
    findings = screen.screen_source(CHEATS[name], PROTECTED, MODULES)
    assert findings, f"the screen let {name!r} through:\n{CHEATS[name]}"
    assert all(str(finding) for finding in findings)


@pytest.mark.parametrize("lab", LABS)
def test_screen_passes_every_committed_solution(lab):
    """The screen is strict, but not against the solutions learners are shown."""
    protected, modules = grader.protected_names(build.read_master(lab))
    solution = nbformat.read(REPO_ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    for cell in solution.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("solution"):
            assert screen.screen_source(cell.source, protected, modules) == [], meta["grade_id"]


def test_screen_allows_ordinary_solution_code():
    source = (
        "import torch\nimport triton\nimport triton.language as tl\nfrom dataclasses import dataclass\n"
        "@dataclass\nclass Block:\n    size: int\n    def __post_init__(self):\n        assert self.size > 0\n"
        "class Cache:\n    def __init__(self, n):\n        super().__init__()\n        self.slots = list(range(n))\n"
        "    @property\n    def free(self):\n        return len(self.slots)\n"
        "def attend(q, k, v, scale):\n    w = torch.softmax((q @ k.T) * scale, dim=-1)\n    return w @ v\n"
        "llama_tokens_per_s = 3.35e12 / (6.74e9 * 2)\nresult = [x * 2 for x in range(4)]\n"
    )
    assert screen.screen_source(source, PROTECTED, MODULES) == []


def test_screen_lets_a_local_name_shadow_a_lab_name_inside_a_function():
    assert screen.screen_source("def f(llm):\n    llm = llm + 1\n    return llm", PROTECTED, MODULES) == []
    assert screen.screen_source("def f(decode):\n    decode['x'] = 1\n    out = {}\n    out['y'] = 2\n    return decode",
                                PROTECTED, MODULES) == []
    assert screen.screen_source("llm = 1", PROTECTED, MODULES)


def test_screen_leaves_syntax_errors_to_python():
    assert screen.screen_source("def f(:\n  pass", PROTECTED, MODULES) == []


# --- the runtime guard, in a real IPython shell -------------------------------------------------


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    from grading import guard

    ip = InteractiveShell.instance()
    guard._GUARD = None
    ip.run_cell("import grading.guard as _minillm_guard; _minillm_guard.install(get_ipython())")
    yield ip
    for event in ("pre_run_cell", "post_run_cell"):
        for callback in list(ip.events.callbacks[event]):
            if getattr(callback, "__self__", None) is guard._GUARD:
                ip.events.unregister(event, callback)
    guard._GUARD = None
    ip.input_transformers_post.clear()
    ip.ast_transformers.clear()


def _test_cell(ip, body: str, name: str = "test_x"):
    return ip.run_cell(f"import grading.guard as _minillm_guard; _minillm_guard.verify({name!r})\n{body}")


def test_graded_kernel_finds_the_guard_from_the_course_folder(tmp_path):
    """The graded kernel runs in a throwaway course folder, and grading/ is no part of minillm: the
    grader's environment makes `grading.guard` importable there (its first cell imports it)."""
    import subprocess
    import sys

    env = grader._kernel_env(quick=True)
    source = grader.GUARD_SOURCE.split("\n")[0] + "; print(_minillm_guard.__file__)"
    done = subprocess.run([sys.executable, "-c", source], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == REPO_ROOT / "grading" / "guard.py"


def test_guard_passes_an_honest_run(shell):
    assert shell.run_cell("import math\nfrom minillm.lab import common\nx = math.sqrt(4)").success
    result = _test_cell(shell, "assert x == 2")
    assert result.success, result.error_in_exec


@pytest.mark.parametrize(
    "cheat, what",
    [
        ("get_ipython().input_transformers_post.append(lambda lines: ['try:\\n'] + ['    ' + l for l in lines] + "
         "['\\nexcept BaseException:\\n    pass\\n'])", "input_transformers_post"),
        ("import sys\ndef skip(frame, event, arg):\n    return None\nsys.settrace(skip)", "trace"),
        ("import builtins\nbuiltins.isinstance = lambda *a: True", "isinstance"),
        ("from minillm.lab import common\ncommon.format_si = lambda *a, **k: 'ok'", "format_si"),
        ("import math\nmath.isclose = lambda *a, **k: True", "math.isclose"),
        ("get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)", "custom exception"),
    ],
)
def test_guard_restores_and_fails_every_later_test(shell, cheat, what):
    import math

    from minillm.lab import common

    isclose, format_si = math.isclose, common.format_si
    assert shell.run_cell(cheat).success
    result = _test_cell(shell, "assert 1 == 2")
    assert not result.success
    assert type(result.error_in_exec).__name__ == "GradingIntegrityError", result.error_in_exec
    assert what in str(result.error_in_exec) or what in str(_guard_records())
    assert math.isclose is isclose and common.format_si is format_si
    assert not shell.input_transformers_post and shell.custom_exceptions == ()
    import sys

    assert sys.gettrace() is None or "coverage" in type(sys.gettrace()).__module__


def _guard_records():
    from grading import guard

    return guard._GUARD.violations


def test_guard_names_a_change_made_while_a_test_cell_ran(shell):
    shell.run_cell("def sneaky():\n    import math\n    math.pi = 3\n    return True")
    _test_cell(shell, "assert sneaky()", name="test_sneaky")
    records = _guard_records()
    assert {"when": "while a cell ran", "cell": "test_sneaky", "changes": ["math.pi"]} in records


# --- the graded copy --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def courses(tmp_path_factory):
    """The grading course of every lab, built once (generate_assignment, no execution)."""
    root = tmp_path_factory.mktemp("grading-course") / "course"
    return grader.prepare_course(root, LABS)


@pytest.mark.parametrize("lab", LABS)
def test_cheating_copy_grades_as_the_untouched_copy(courses, lab):
    """Whatever the cheats, what runs is the untouched lab: extra cells dropped, every cheating
    solution cell replaced by the stub (and named), every test from the master."""
    course = courses[lab]
    untouched = grader.graded_copy(nbformat.read(REPO_ROOT / "labs" / f"{lab}.ipynb", as_version=4), course)
    cheat = grader.graded_copy(cheating_copy(lab), course)
    assert untouched.flags == [] and untouched.zeroed == {}
    assert len(cheat.notebook.cells) == len(untouched.notebook.cells)
    solution_ids = [c.metadata["nbgrader"]["grade_id"] for c in untouched.notebook.cells
                    if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")]
    assert solution_ids
    for mine, theirs in zip(cheat.notebook.cells, untouched.notebook.cells):
        if mine.source != theirs.source:
            assert mine.source == grader.STUB and "raise NotImplementedError()" in theirs.source
    assert sum(f.startswith("solution cell") and "not run" in f for f in cheat.flags) == len(solution_ids)
    assert any("not part of the lab" in note for note in cheat.notes)
    assert cheat.zeroed == {}


@pytest.mark.parametrize("lab", LABS)
def test_graded_copy_carries_the_gradebook_source_and_checksums(courses, lab):
    """So nbgrader logs no checksum change for an untouched submission, and the hidden tests run."""
    from nbgrader.utils import compute_checksum

    course = courses[lab]
    copy_ = grader.graded_copy(nbformat.read(REPO_ROOT / "labs" / f"{lab}.ipynb", as_version=4), course)
    assert copy_.notebook.cells[0].source == grader.GUARD_SOURCE
    tests = [c for c in copy_.notebook.cells if grader._is_test(c)]
    assert tests and any(grader.HIDDEN_BEGIN in c.source for c in tests)
    for cell in copy_.notebook.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("locked"):
            assert compute_checksum(cell) == meta["checksum"] == course.sources[meta["grade_id"]][1], meta["grade_id"]
    for cell in tests:
        assert cell.source.startswith(f"import grading.guard as _minillm_guard; _minillm_guard.verify({cell.metadata['nbgrader']['grade_id']!r})")


def test_deleted_and_replaced_test_cells_are_zeroed_and_flagged(courses):
    lab = LABS[0]
    nb = nbformat.read(REPO_ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    tests = [c for c in nb.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]
    deleted, replaced = tests[0], tests[1]
    replaced.source = "pass"
    nb.cells.remove(deleted)
    copy_ = grader.graded_copy(nb, courses[lab])
    deleted_id, replaced_id = deleted.metadata["nbgrader"]["grade_id"], replaced.metadata["nbgrader"]["grade_id"]
    assert set(copy_.zeroed) == {deleted_id, replaced_id}
    assert f"locked cell {deleted_id} was deleted" in copy_.flags and f"locked cell {replaced_id} was changed" in copy_.flags
    sources = {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in copy_.notebook.cells}
    assert sources[replaced_id] == courses[lab].sources[replaced_id][0]  # the master's test still runs


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"cells": [', "invalid notebook JSON at byte 11"),
        ('{"cells": [}', "invalid notebook JSON at byte 11"),
        ("\xff\xfe", "not UTF-8"),
        ("[1, 2]", "not a Jupyter notebook"),
    ],
)
def test_unreadable_submissions_say_why(tmp_path, text, reason):
    path = tmp_path / "nb.ipynb"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(grader.SubmissionError, match=reason.replace("(", r"\(")):
        grader.read_submission(path)


# --- feedback -----------------------------------------------------------------------------------


def test_feedback_message_hides_hidden_tests():
    source = "import x; verify('t')\nassert f(1) == 1\n### BEGIN HIDDEN TESTS\nassert f(2) == 4, 'f(2) should be 4'\n### END HIDDEN TESTS"
    hidden = ["assert f(2) == 4, 'f(2) should be 4'"]
    in_hidden = {"ename": "AssertionError", "evalue": "f(2) should be 4",
                 "traceback": ["\x1b[0;31mAssertionError\x1b[0m", "Cell In[7], line 4\n----> 4 assert f(2) == 4"]}
    in_visible = {"ename": "AssertionError", "evalue": "f(1) is wrong", "traceback": ["Cell In[7], line 2\n"]}
    quoting = {"ename": "AssertionError", "evalue": "assert f(2) == 4, 'f(2) should be 4'", "traceback": []}
    assert feedback.visible_message(in_hidden, source, hidden) == "a hidden test failed (AssertionError)"
    assert feedback.visible_message(in_visible, source, hidden) == "AssertionError: f(1) is wrong"
    assert feedback.visible_message(quoting, source, hidden) == f"AssertionError: {feedback.WITHHELD}"


def test_quick_times_give_every_lab_a_cell_timeout():
    times = grader.quick_times()
    assert set(times) == set(LABS), "run `python grading/autograde.py --measure` after adding a lab"
    for lab in LABS:
        timeout = grader.cell_timeout_for(lab, times)
        assert grader.MIN_CELL_TIMEOUT_S <= timeout <= grader.DEFAULT_CELL_TIMEOUT_S
        assert timeout >= grader.TIMEOUT_PER_SLOWEST_CELL * times[lab]["slowest_cell_s"]
