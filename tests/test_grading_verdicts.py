"""Verdicts from data the grader owns: no name bound inside the sandbox decides a verdict, and no check helper
inside it computes an expected answer (issue 52, item 4).

- What a locked cell bound is the grader's own: a cell run only in the sandbox (the learner's own run) is taken
  once, as data, when it ends; a cell run only in the grader keeps its data there; a cell run in both is the
  grader's run. A submission that rebinds every such name in its solution cells, to values its hard-coded
  answers agree with, earns nothing: on the probe lab below, whose tests compare with each kind, and on lab 00.
- Every ``check_*`` of every ``minillm.lab`` module refuses in every lab's sandbox (a loop over candidates finds
  no answer through one), and so do the helpers that compute expected answers, where the lab's own sandbox code
  does not need them; lab 10's answer check computes its answer only where the grader runs.

The controls run the same attempts outside the sandbox, where they do what they aim at.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from lab_utils import write_master

from grading import build, grader, references, remote, sandbox

REPO_ROOT = build.REPO_ROOT
LAB10 = "10_many_models"


def check_helpers() -> list[str]:
    """"module:function" of every check_* function of every minillm.lab module (its own, not imported)."""
    import minillm.lab

    found = []
    for info in pkgutil.iter_modules(minillm.lab.__path__):
        module = importlib.import_module(f"minillm.lab.{info.name}")
        found += [f"{module.__name__}:{name}" for name, fn in inspect.getmembers(module, inspect.isfunction)
                  if name.startswith("check_") and fn.__module__ == module.__name__]
    return sorted(found)


def locked_names(master) -> list[str]:
    """Every name a locked code cell of the master binds (imports included), whatever it runs in."""
    names: set[str] = set()
    for cell in master.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and not meta.get("solution") and not meta.get("grade"):
            names |= grader.bound_names(cell.source)
    return sorted(names)


def rebinding(names, value: str = "None") -> str:
    """A solution cell's lines that rebind each name (to garbage): the sandbox's copy is theirs to change."""
    return "".join(f"{name} = {value}\n" for name in names)


CALL_EVERY_CHECK = '''
import importlib, inspect
check_outcomes = {}
for _ref in %r:
    _module, _, _name = _ref.partition(":")
    _fn = getattr(importlib.import_module(_module), _name)
    _params = inspect.signature(_fn).parameters.values()
    _args = [None for p in _params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    _kwargs = {p.name: None for p in _params if p.default is p.empty and p.kind is p.KEYWORD_ONLY}
    try:
        _fn(*_args, **_kwargs)
        check_outcomes[_ref] = "ran"
    except BaseException as _error:
        check_outcomes[_ref] = f"{type(_error).__name__}: {_error}"
'''

# Lab 10's answer through every helper that knows it: its check over candidate answers, the reference, the
# engine's own count. Outside the sandbox each finds 12.88.
ORACLE_LOOP = '''
import importlib
lab10 = importlib.import_module("minillm.lab.lab10")
answer_active_params_b = None
for _candidate in [i / 100 for i in range(1000, 1700)]:
    try:
        lab10.check_answer_active_params_b(_candidate)
    except Exception:
        continue
    answer_active_params_b = _candidate + 0.1   # the first the check takes is 0.15 low: the middle of its range
    break
for _route in (lambda: lab10.active_params_b(), lambda: lab10.PRESETS["mixtral-8x7b"].num_active_params / 1e9):
    if answer_active_params_b is None:
        try:
            answer_active_params_b = _route()
        except Exception:
            pass
'''


# --------------------------------------------------------------------------- in one sandbox, cell by cell
@pytest.fixture(scope="module")
def lab10_session(tmp_path_factory):
    """A sandbox with lab 10's library (its declared references and the stubs by rule), as its grading has."""
    if not sandbox.status().available:
        pytest.fail(f"make test needs the sandbox: {sandbox.status().reason}")
    from minillm.config import cache_root

    root = tmp_path_factory.mktemp("verdicts")
    master = build.read_master(LAB10)
    library = references.prepare(LAB10, references.declared(master), root / "library", master=master)
    scratch = root / "scratch"
    scratch.mkdir()
    spec = {"scratch": str(scratch), "runner_dir": str(library.runner_dir), "package_binds": library.package_binds,
            "bans": library.bans, "env": {"OMP_NUM_THREADS": "1"}, "cache_root": str(cache_root()),
            "log": str(root / "sandbox.log"), "report": str(root / "events.jsonl"), "cell_timeout_s": 60,
            "call_timeout_s": 60, "python": sys.executable, "limits": vars(sandbox.Limits())}
    session = remote.Session(spec)
    remote._SESSION = session
    yield session
    session.close()
    remote._SESSION = None


def test_a_locked_cells_names_stay_the_graders_whatever_the_learner_rebinds(lab10_session):
    """A sandbox cell's names are taken once, as data (a function of it is refused: the learner could change what
    it runs); a grader cell's data reaches the learner's code but is never read back; the learner's names are
    fetched before every cell, until a locked cell binds the same name."""
    ns: dict = {}
    remote.sandbox_cell(ns, "measure", "expected = [6 * 7]\nrow = 1\ndef helper():\n    return 42",
                        ["expected", "row", "helper"], True)
    assert ns["expected"] == [42] and ns["row"] == 1
    assert isinstance(ns["helper"], remote.Refused)
    ns["target"] = [10, 20]
    remote.push_after(ns, "grader_cell", ["target"])
    remote.learner_cell(ns, "answers", "seen = list(target)\nexpected.append(7)\nexpected = [7]\ntarget.append(0)\n"
                                       "target = [0]\nrow = 'mine'\nanswer = 7", ["answer", "seen", "row"])
    assert ns["answer"] == 7 and ns["seen"] == [10, 20], "the learner's code computed from the grader's data"
    assert ns["row"] == "mine", "a name the solution cell binds is the learner's answer"
    remote.sandbox_cell(ns, "again", "row = 2", ["row"], True)
    remote.learner_cell(ns, "later", "row = 'changed'\nexpected = [0]\ntarget = [1]\nlate = 1", ["late"])
    remote.refresh(ns, "test")
    assert ns["expected"] == [42] and ns["target"] == [10, 20] and ns["row"] == 2 and ns["late"] == 1, ns
    session = lab10_session
    assert set(session.bound) == {"answer", "seen", "late"} and {"expected", "target", "row"} <= set(session.held)
    # the control: the sandbox's own copies are what the learner made of them
    assert session.get(["expected", "target", "row"]) == {"expected": [0], "target": [1], "row": "changed"}


def test_every_check_helper_refuses_in_the_sandbox_and_runs_outside(lab10_session):
    helpers = check_helpers()
    assert len(helpers) > 100
    reply = lab10_session.run("checks", CALL_EVERY_CHECK % (helpers,))
    assert reply.get("error") is None, reply["error"]
    outcomes = lab10_session.get(["check_outcomes"])["check_outcomes"]
    assert set(outcomes) == set(helpers)
    for ref, outcome in outcomes.items():
        dotted = ref.replace(":", ".")
        assert outcome.startswith("ReferenceUnavailable: ") and dotted in outcome and "checks" in outcome, (ref, outcome)
    assert set(reply["references"]) == {ref.replace(":", ".") for ref in helpers}, "each refusal is reported"
    scope: dict = {}
    exec(CALL_EVERY_CHECK % (helpers,), scope)  # the control: outside the sandbox they are the real checks
    assert not any(outcome.startswith("ReferenceUnavailable") for outcome in scope["check_outcomes"].values())


def test_lab10_answer_has_no_oracle_in_the_sandbox(lab10_session):
    reply = lab10_session.run("oracle", ORACLE_LOOP)
    assert reply.get("error") is None, reply["error"]
    assert lab10_session.get(["answer_active_params_b"])["answer_active_params_b"] is None
    used = set(reply["references"])
    assert {"minillm.lab.lab10.check_answer_active_params_b", "minillm.lab.lab10.active_params_b",
            "minillm.models.config.ModelConfig.num_active_params"} <= used, used
    scope: dict = {}
    exec(ORACLE_LOOP, scope)  # the control: outside the sandbox the loop finds the answer
    assert abs(scope["answer_active_params_b"] - 12.88) < 0.15


def test_every_labs_sandbox_stubs_every_check_and_no_lab_needs_one(tmp_path):
    """Stubbed by rule in every lab's library (no declaration needed); and no locked cell that runs in a lab's
    sandbox, nor its model answers, reaches a check helper (so stubbing them breaks no lab)."""
    helpers = {ref.replace(":", ".") for ref in check_helpers()}
    for lab in build.discover_labs():
        master = build.read_master(lab)
        reached = references.reached(references.sandbox_sources(master))
        assert not {ref.rpartition(".")[2] for ref in helpers} & reached, f"{lab}'s sandbox code calls a check"
        stubbed = {f"{module}.{name}" for module, name, _ in references.grading_only(lab, master)}
        assert helpers <= stubbed, f"{lab}: {sorted(helpers - stubbed)[:5]} not stubbed"
        assert not {name.rpartition(".")[2] for name in stubbed - helpers} & reached, f"{lab} needs a stubbed helper"


# --------------------------------------------------------------------------- graded: the probe lab
VERDICTS_LAB = "98_verdicts"


def _verdicts_master(source_dir: Path) -> Path:
    """A master whose tests compare with each kind of locked data (a sandbox cell's run, a grader cell's data,
    a cell run in both), and lab 10's answer exercise with its test and references: 4 points."""
    lab10 = build.read_master(LAB10)
    by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in lab10.cells}
    answer, test = by_id["answer_active_params_b"], by_id["test_answer_active_params_b"]

    def test_cell(grade_id, source):
        return ("code", source, {"grade_id": grade_id, "grade": True, "solution": False, "locked": True, "points": 1})

    cells = [
        ("code", "import os\nfrom minillm.lab import lab10\nlimit = 3", {}),
        ("code", "expected = 6 * 7   # the learner's own run, in the sandbox", {}, {"minillm": {"runs_in": "sandbox"}}),
        ("code", "target = [10, 20]   # measured by the grader", {}, {"minillm": {"runs_in": "grader"}}),
        ("code", "### BEGIN SOLUTION\nanswer = 6 * 7\nhalf = [t / 2 for t in target]\n### END SOLUTION",
         {"grade_id": "answers", "solution": True, "grade": False, "locked": False}),
        test_cell("test_sandbox_run", "assert answer == expected, (answer, expected)"),
        test_cell("test_grader_data", "assert half == [t / 2 for t in target], (half, target)"),
        test_cell("test_both", "assert answer == 14 * limit, (answer, limit)"),
        ("code", answer.source, dict(answer.metadata["nbgrader"])),
        ("code", test.source, dict(test.metadata["nbgrader"])),
    ]
    refs = {"answer_active_params_b": references.declared(lab10)["answer_active_params_b"]}
    return write_master(source_dir, VERDICTS_LAB, cells, {"minillm": {"references": refs}})


def _with_solutions(text: str, **sources) -> str:
    nb = nbformat.reads(text, as_version=4)
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in sources:
            cell.source = sources[grade_id]
    return nbformat.writes(nb)


def _submit(folder: Path, student: str, lab: str, text: str) -> Path:
    path = folder / student / lab / f"{lab}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def verdicts_batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdicts-batch")
    source_dir = root / "source"
    master_path = _verdicts_master(source_dir)
    master = build.read_master(VERDICTS_LAB, source_dir)
    rendered = build.render(source_dir)
    student, solution = rendered[f"labs/{VERDICTS_LAB}.ipynb"], rendered[f"solutions/{VERDICTS_LAB}.ipynb"]
    garbage = rebinding(locked_names(master))
    rebinds = _with_solutions(student, answers=garbage + "expected = 7\ntarget = [0, 0]\nlimit = 0.5\nanswer = 7\n"
                                                           "half = [0.0, 0.0]\n",
                              answer_active_params_b=garbage + ORACLE_LOOP)
    solution_source = {c.metadata["nbgrader"]["grade_id"]: c.source for c in nbformat.reads(solution, as_version=4).cells
                       if c.metadata.get("nbgrader", {}).get("solution")}
    calls_checks = _with_solutions(solution, answers=CALL_EVERY_CHECK % (check_helpers(),) + solution_source["answers"])
    students = {"solved": solution, "rebinds": rebinds, "calls_checks": calls_checks}
    paths = {name: {VERDICTS_LAB: _submit(root / "submitted", name, VERDICTS_LAB, text)} for name, text in students.items()}
    rows = grader.autograde(paths, source_dir=source_dir, jobs=2)
    assert master_path.is_file()
    return {row["student"]: row for row in rows}


def test_rebinding_every_locked_name_earns_nothing(verdicts_batch):
    """Each test compares the learner's answers with locked data; the submission rebinds every locked name to
    what its hard-coded answers agree with, and reaches lab 10's answer only through the helpers that know it."""
    solved, cheat = verdicts_batch["solved"], verdicts_batch["rebinds"]
    assert (solved["status"], solved["score"], solved["max_score"], solved["reason"]) == ("graded", 4.0, 4.0, ""), solved
    assert (cheat["status"], cheat["score"]) == ("graded", 0.0), cheat
    assert set(cheat["failures"]) == {"test_sandbox_run", "test_grader_data", "test_both", "test_answer_active_params_b"}
    for reached in ("check_answer_active_params_b", "active_params_b", "ModelConfig.num_active_params"):
        assert reached in cheat["reason"], cheat["reason"]


def test_calling_every_check_helper_is_refused_and_named(verdicts_batch):
    row = verdicts_batch["calls_checks"]
    assert (row["status"], row["score"]) == ("graded", 4.0), row
    for ref in check_helpers():
        assert f"refused in answers: the reference {ref.replace(':', '.')} " in row["reason"], ref


# --------------------------------------------------------------------------- graded: lab 00
LAB00 = "00_setup"
# A request the engine never ran, and the answers it implies: 100 prompt tokens in a TTFT of 1 s, 10 more
# tokens in the next second (TPOT 0.1 s), so decode is 90 % of the time from 91 output tokens.
FAKE_METRICS = ("RequestMetrics(num_prompt_tokens=100, num_output_tokens=11, ttft_s=1.0, tpot_s=0.1, e2e_s=2.0, "
                "queue_s=0.0, itl_s=[0.1] * 10)")
HARD_CODED = {"measure_rates": "prompt_tokens_per_s = 100.0\ndecode_tokens_per_s = 10.0\n",
              "answer_decode_90": "answer_decode_90_tokens = 91\n"}
# ... and the engine in the sandbox replaced by one that serves it to the cells that measure it
FAKE_ENGINE = textwrap.dedent(f'''
    from minillm.engine.metrics import RequestMetrics
    from minillm.outputs import CompletionOutput, RequestOutput
    metrics = {FAKE_METRICS}


    class _MadeUp:
        def generate(self, *args, **kwargs):
            return [RequestOutput(request_id="0", prompt="", prompt_token_ids=[1] * 100, finished=True, metrics=metrics,
                                  outputs=[CompletionOutput(index=0, text="", token_ids=[1] * 11, finish_reason="length")])]


    llm = _MadeUp()
''')


def test_lab00_fake_answers_pass_its_checks_where_the_data_is_theirs():
    """The control: the hard-coded answers agree with the made-up request (the verdicts below are not failing
    by accident)."""
    from minillm.engine.metrics import RequestMetrics  # noqa: F401 - FAKE_METRICS names it
    from minillm.lab import lab00

    fake = eval(FAKE_METRICS)  # noqa: S307 - our own constant
    lab00.check_rates(fake, 100.0, 10.0)
    lab00.check_answer_decode_90(91, fake)


def test_lab00_rebinding_every_locked_name_earns_nothing(tmp_path):
    """Every solution cell rebinds every name a locked cell of lab 00 binds (the measured request to a made-up
    one, the engine to one that serves it, every other to None) and hard-codes the answers that agree with it.
    No exercise is done: 0 of 9."""
    master = build.read_master(LAB00)
    garbage = rebinding(locked_names(master)) + FAKE_ENGINE
    stubs = {c.metadata["nbgrader"]["grade_id"]: c.source
             for c in nbformat.read(REPO_ROOT / "labs" / f"{LAB00}.ipynb", as_version=4).cells
             if c.metadata.get("nbgrader", {}).get("solution")}
    assert set(stubs) >= set(HARD_CODED)
    sources = {gid: garbage + HARD_CODED.get(gid, stub) for gid, stub in stubs.items()}
    text = _with_solutions((REPO_ROOT / "labs" / f"{LAB00}.ipynb").read_text(encoding="utf-8"), **sources)
    (row,) = grader.autograde({"rebinds": {LAB00: _submit(tmp_path, "rebinds", LAB00, text)}})
    assert (row["status"], row["score"], row["max_score"]) == ("graded", 0.0, 9.0), row
    assert {"test_measure_rates", "test_answer_decode_90"} <= set(row["failures"]), row["failures"]
