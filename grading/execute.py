"""Run one graded copy: the master's cells in the grader's kernel, the student's cells in the sandbox.

:class:`GradingExecute` is nbgrader's Execute step with three changes:

- **lockstep**: each code cell runs where the plan says (grading.grader writes it per lab): a solution
  cell runs in the submission's sandbox (``grading.remote.learner_cell``), its names bound in the kernel
  as data or handles; a locked cell runs in both (the learner's code may need its state) or, when the
  master marks it ``"minillm": {"runs_in": "sandbox"}``, only there, its names then taken as data; a
  test cell runs only in the kernel, where no student code runs. The kernel executes a call in place of
  the cell's source; the source is put back afterwards, so the notebook shows what the student wrote.
- **a dead kernel** costs the cell that killed it: a fresh kernel replays the cells before it (their
  outputs kept from the first run) and goes on; after ``max_restarts`` deaths the rest is "not run".
- **timing**: each cell's wall time and every death go to a JSON report.

``python -m grading.execute GRADED OUT --plan PLAN --report REPORT --timeout S`` runs one notebook (the
grader runs several at once, one process each); :class:`ReplayOutputs` then stands in for Execute when
nbgrader autogrades, copying these outputs in, so the gradebook is written after every sandbox is gone.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

if not __package__:  # run as a script
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from jupyter_core.utils import run_sync  # noqa: E402
from nbclient.exceptions import DeadKernelError  # noqa: E402
from nbformat.notebooknode import NotebookNode  # noqa: E402
from nbgrader.preprocessors import Execute, NbGraderPreprocessor  # noqa: E402
from traitlets import Dict, Integer, Unicode  # noqa: E402

REPORT_ENV = "MINILLM_EXECUTE_REPORT"
EXECUTED_ENV = "MINILLM_EXECUTED_DIR"
MODULE = "_minillm_sandbox"
START_SOURCE = f"import grading.remote as {MODULE}\n{MODULE}.start()"


def _cell_name(cell, index: int) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id") or f"#{index}"  # "cell #12": the 13th cell


def _error(ename: str, evalue: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def kernel_source(step: dict, source: str, name: str) -> str:
    """What the grader's kernel runs for a cell whose plan entry is ``step``."""
    kind = step.get("kind", "both")
    names = list(step.get("names", []))
    if kind == "learner":  # the master's version's imports run here: the cells after it may use the modules
        imports = "".join(f"{line}\n" for line in step.get("imports", []))
        kernels = list(step.get("kernels", []))
        return f"{imports}{MODULE}.learner_cell(globals(), {name!r}, {source!r}, {names!r}, {kernels!r})"
    if kind == "sandbox":  # its imports run here too: the cells after it may use the modules
        imports = "".join(f"{line}\n" for line in step.get("imports", []))
        return f"{imports}{MODULE}.sandbox_cell(globals(), {name!r}, {source!r}, {names!r}, True)"
    if kind == "both":  # the learner's names first, then the sandbox starts its copy while this one runs
        return (f"{MODULE}.refresh(globals(), {name!r}); "
                f"{MODULE}.sandbox_cell(globals(), {name!r}, {source!r}, [], False)\n{source}")
    if kind == "grader":  # runs here only; what it binds goes to the sandbox as data, before the next cell
        return f"{MODULE}.refresh(globals(), {name!r}); {MODULE}.push_after(globals(), {name!r}, {names!r})\n{source}"
    return source  # "start", "test" (its preamble refreshes), or a cell the plan does not know


class GradingExecute(Execute):
    max_restarts = Integer(2, help="kernel restarts per notebook before the remaining cells are skipped").tag(config=True)
    report_path = Unicode("", help=f"where to write the per-cell report (default: ${REPORT_ENV})").tag(config=True)
    plan = Dict({}, help="{cell index: {kind, names}}: where each code cell runs (grading.grader.plan)").tag(config=True)

    def preprocess(self, nb, resources=None, km=None):
        self._report = {"cells": [], "deaths": [], "restarts": 0}
        self._gave_up_at: str | None = None
        self._skip_on_replay: set[int] = set()  # cells that timed out: replaying them costs the timeout again
        try:
            return super().preprocess(nb, resources, km=km)
        finally:
            path = self.report_path or os.environ.get(REPORT_ENV)
            if path:
                with open(path, "w", encoding="utf-8") as handle:
                    json.dump(self._report, handle, indent=1)

    async def _run(self, cell, cell_index, execution_count, store_history, base):
        """Execute ``cell`` as the plan says: its source swapped for the kernel's call, then put back."""
        step = self.plan.get(str(cell_index))
        if step is None or cell.cell_type != "code":
            return await base(self, cell, cell_index, execution_count, store_history)
        original = cell.source
        cell.source = kernel_source(step, original, _cell_name(cell, cell_index))
        try:
            return await base(self, cell, cell_index, execution_count, store_history)
        finally:
            cell.source = original

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        if cell.cell_type != "code" or not cell.source.strip():
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        name = _cell_name(cell, cell_index)
        if self._gave_up_at is not None:
            cell.outputs = [_error("NotRun", f"not run: the kernel died {self._report['restarts'] + 1} times, "
                                             f"last in {self._gave_up_at}")]
            self._report["cells"].append({"name": name, "seconds": 0.0, "status": "not run"})
            return cell
        start = time.perf_counter()
        try:
            result = await self._run(cell, cell_index, execution_count, store_history, Execute.async_execute_cell)
        except DeadKernelError:
            seconds = time.perf_counter() - start
            cell.outputs.append(_error("KernelDied", f"the kernel died in cell {name} (after {seconds:.1f} s); "
                                                     "the cells after it ran in a fresh kernel"))
            self._report["cells"].append({"name": name, "seconds": seconds, "status": "kernel died"})
            self._report["deaths"].append(name)
            if self._report["restarts"] >= self.max_restarts:
                self._gave_up_at = name
                return cell
            await self._restart_and_replay(cell_index)
            return cell
        seconds = time.perf_counter() - start
        timed_out = any(o.get("ename") == "CellTimeoutError" for o in cell.get("outputs", []) if o.output_type == "error")
        if timed_out:
            self._skip_on_replay.add(cell_index)
        self._report["cells"].append({"name": name, "seconds": seconds, "status": "timed out" if timed_out else "ran"})
        return result

    # nbconvert's preprocess_cell calls the sync execute_cell, which nbclient binds to its own
    # async_execute_cell at class creation: bind it to this one.
    execute_cell = run_sync(async_execute_cell)

    async def _restart_and_replay(self, died_at: int) -> None:
        """A fresh kernel (and sandbox) with the state the notebook had before cell ``died_at``."""
        self._report["restarts"] += 1
        self.log.warning("kernel died in cell %d: restarting it and replaying the %d cells before", died_at, died_at)
        if self.kc is not None:
            self.kc.stop_channels()
        await self.km.restart_kernel(now=True)
        await self.async_start_new_kernel_client()
        for index in range(died_at):
            earlier = self.nb.cells[index]
            if earlier.cell_type != "code" or not earlier.source.strip() or index in self._skip_on_replay:
                continue
            replay = copy.deepcopy(earlier)  # outputs of the first run stay in the notebook
            try:
                await self._run(replay, index, None, False, Execute.async_execute_cell)
            except DeadKernelError:
                self._gave_up_at = _cell_name(earlier, index)
                return


class ReplayOutputs(NbGraderPreprocessor):
    """nbgrader's Execute step for autograding after the run: the outputs each cell had when
    grading.execute ran it (``$MINILLM_EXECUTED_DIR/<student>/<lab>.ipynb``), copied in by position."""

    def preprocess(self, nb, resources):
        import nbformat

        info = resources.get("nbgrader", {})
        path = Path(os.environ[EXECUTED_ENV]) / str(info.get("student")) / f"{info.get('notebook')}.ipynb"
        if not path.is_file():
            for cell in nb.cells:
                if cell.cell_type == "code":
                    cell.outputs = [_error("NotRun", "the notebook was not executed (the grader's run of it failed)")]
            return nb, resources
        executed = nbformat.read(path, as_version=4)
        if len(executed.cells) != len(nb.cells):
            raise RuntimeError(f"{path} has {len(executed.cells)} cells, the graded copy {len(nb.cells)}")
        for cell, ran in zip(nb.cells, executed.cells):
            if cell.cell_type == "code":
                cell.outputs = ran.get("outputs", [])
                cell.execution_count = ran.get("execution_count")
        return nb, resources


def execute(graded: Path, out: Path, plan: dict, report: Path, timeout_s: int, cwd: Path) -> None:
    """Run the graded copy at ``graded`` (kernel in ``cwd``), write it executed to ``out``."""
    import nbformat

    nb = nbformat.read(graded, as_version=4)
    executor = GradingExecute(timeout=timeout_s, interrupt_on_timeout=True, report_path=str(report),
                              plan=plan, kernel_name="python3", startup_timeout=120)
    executor.preprocess(nb, {"metadata": {"path": str(cwd)}})
    nbformat.write(nb, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run one graded copy (grading.grader runs this)")
    parser.add_argument("graded", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--timeout", type=int, required=True, help="per-cell limit of the grader's kernel (s)")
    parser.add_argument("--cwd", type=Path, required=True)
    args = parser.parse_args(argv)
    execute(args.graded, args.out, json.loads(args.plan.read_text(encoding="utf-8")), args.report, args.timeout, args.cwd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
