"""The runtime guard of a graded kernel: what the static screen could miss, caught as it happens.

The grader puts two things into the graded copy of a lab (never into labs/): a first cell that
calls :func:`install`, and a first line in every test cell that calls :func:`verify`. ``install``
takes a snapshot of everything a cell could change to alter how later cells run or what the
checks see, and registers IPython callbacks before and after every cell:

- IPython's input transformers and AST transformers, its custom exception handler;
- ``sys.settrace`` / ``sys.setprofile`` (tracers can jump over an ``assert``);
- every builtin (``isinstance``, ``AssertionError`` ...), and every public attribute of the
  ``minillm`` modules already imported, ``math`` and ``torch``'s top level (the helpers and
  the checks), and which module object ``sys.modules`` holds for each.

Before a cell runs (before IPython transforms its source) the callback puts back whatever
changed; after it, the same. Each change is recorded, with the cell that made it; ``verify``
then raises :class:`GradingIntegrityError` in every later test cell, so those earn nothing, and
the grader reads the record (``MINILLM_GUARD_REPORT``) to zero a test cell during which a change
happened. Code in the kernel can in principle undo anything in the kernel: the guard is the
second line, behind the screen of the source (grading/screen.py) that runs outside it.

The graded kernel runs in a throwaway course folder and imports this module as ``grading.guard``:
the grader puts the repository root on the kernel's ``PYTHONPATH`` (grading/grader.py). It uses
the standard library only, so the kernel loads nothing else of the grader.
"""

from __future__ import annotations

import builtins
import json
import os
import sys

REPORT_ENV = "MINILLM_GUARD_REPORT"


class GradingIntegrityError(AssertionError):
    """A cell changed how later cells run or what the checks do; this test cannot be trusted."""


class _Guard:
    def __init__(self, shell):
        self.shell = shell
        self.current = "setup"  # the test cell running now (verify names it), else the last one
        self.cell_number = 0
        self.violations: list[dict] = []
        self.report_path = os.environ.get(REPORT_ENV)
        self._trace, self._profile = sys.gettrace, sys.getprofile
        self._settrace, self._setprofile = sys.settrace, sys.setprofile
        self.snapshot()

    # -- what is watched -----------------------------------------------------------------
    def _module_dicts(self) -> dict[str, dict[str, object]]:
        watched = {}
        for name, module in list(sys.modules.items()):
            if module is None:
                continue
            if name == "minillm" or name.startswith("minillm.") or name in {"math", "torch"}:
                try:
                    items = vars(module)
                except TypeError:
                    continue
                watched[name] = {key: value for key, value in list(items.items()) if not key.startswith("_")}
        return watched

    def snapshot(self) -> None:
        shell = self.shell
        self.state = {
            "input_transformers_cleanup": list(shell.input_transformers_cleanup),
            "input_transformers_post": list(shell.input_transformers_post),
            "ast_transformers": list(shell.ast_transformers),
            "custom_exceptions": shell.custom_exceptions,
            "CustomTB": shell.CustomTB,
        }
        self.builtins = dict(vars(builtins))
        self.module_items = self._module_dicts()
        self.modules = {name: sys.modules[name] for name in self.module_items}

    def _lists(self):
        shell = self.shell
        return {
            "input_transformers_cleanup": shell.input_transformers_cleanup,
            "input_transformers_post": shell.input_transformers_post,
            "ast_transformers": shell.ast_transformers,
        }

    # -- check and restore ---------------------------------------------------------------
    def check_and_restore(self, when: str) -> list[str]:
        changes = []
        if self._trace() is not None:
            changes.append("a trace function (sys.settrace)")
            self._settrace(None)
        if self._profile() is not None:
            changes.append("a profile function (sys.setprofile)")
            self._setprofile(None)
        for name, current in self._lists().items():
            if list(current) != self.state[name]:
                changes.append(f"{name} changed")
                current[:] = self.state[name]
        shell = self.shell
        if shell.custom_exceptions != self.state["custom_exceptions"] or shell.CustomTB != self.state["CustomTB"]:
            changes.append("a custom exception handler (set_custom_exc)")
            shell.custom_exceptions, shell.CustomTB = self.state["custom_exceptions"], self.state["CustomTB"]
        namespace = vars(builtins)
        for key, value in self.builtins.items():
            if key in KERNEL_MANAGED_BUILTINS:
                continue
            if namespace.get(key, _MISSING) is not value:
                changes.append(f"the builtin {key}")
                namespace[key] = value
        for name, items in self._module_dicts().items():  # imported since: watched from now on
            if name not in self.modules:
                self.modules[name], self.module_items[name] = sys.modules[name], items
        for name, module in self.modules.items():
            if sys.modules.get(name) is not module:
                changes.append(f"sys.modules[{name!r}]")
                sys.modules[name] = module
            items = vars(module)
            package = name.split(".")[0]
            for key, value in self.module_items[name].items():
                current = items.get(key, _MISSING)
                if current is value:
                    continue
                if _from_package(current, package):
                    # the library rebinding its own name (torch wraps manual_seed when dynamo loads)
                    self.module_items[name][key] = current
                    continue
                changes.append(f"{name}.{key}")
                items[key] = value
        if changes:
            record = {"when": when, "cell": self.current, "changes": changes}
            self.violations.append(record)
            self._write(record)
        return changes

    def _write(self, record: dict) -> None:
        if not self.report_path:
            return
        with open(self.report_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    # -- IPython callbacks ---------------------------------------------------------------
    def pre_run_cell(self, info=None) -> None:
        self.cell_number += 1
        self.check_and_restore("before a cell ran")
        self.current = f"cell {self.cell_number}"

    def post_run_cell(self, result=None) -> None:
        self.check_and_restore("while a cell ran")

    def verify(self, name: str) -> None:
        self.current = name
        self.check_and_restore("before this test")
        if self.violations:
            first = self.violations[0]
            raise GradingIntegrityError(
                f"an earlier cell ({first['cell']}) changed {', '.join(first['changes'][:3])}: "
                "what it changes could make a failing check pass, so no test after it is trusted"
            )



_MISSING = object()


def _from_package(value, package: str) -> bool:
    """Whether ``value`` is a function or class of ``package`` itself (not the notebook's, not a builtin)."""
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and (module == package or module.startswith(package + "."))
# Builtins IPython and ipykernel swap around every cell themselves (stdin forwarding, the builtin
# trap, the output cache): their changes are not a cell's doing.
KERNEL_MANAGED_BUILTINS = frozenset(
    {"_", "__", "___", "input", "raw_input", "getpass", "get_ipython", "exit", "quit", "display", "__IPYTHON__",
     "help", "copyright", "credits", "license"}
)
_GUARD: _Guard | None = None


def install(shell) -> None:
    """Snapshot the interpreter and watch it around every cell (the graded copy's first cell)."""
    global _GUARD
    if _GUARD is not None:
        return
    _GUARD = _Guard(shell)
    shell.events.register("pre_run_cell", _GUARD.pre_run_cell)
    shell.events.register("post_run_cell", _GUARD.post_run_cell)


def verify(name: str) -> None:
    """First line of every graded test cell: put back anything changed, and fail this test
    if any cell so far changed it (:class:`GradingIntegrityError`)."""
    if _GUARD is None:
        raise GradingIntegrityError("the grading guard is not installed (the first cell of the graded copy was removed)")
    _GUARD.verify(name)


def read_report(path) -> list[dict]:
    """The guard's records, one dict per change event ({"when", "cell", "changes"})."""
    try:
        with open(path, encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except FileNotFoundError:
        return []


__all__ = ["GradingIntegrityError", "install", "verify", "read_report", "REPORT_ENV"]
