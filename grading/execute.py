"""nbgrader's Execute step, made to survive a dead kernel and to time every cell.

nbgrader's own ``Execute`` gives up on a notebook whose kernel dies (``os._exit``, a segfault,
the OOM killer): it writes nothing for that student, so the points earned before the crash are
lost too. :class:`GradingExecute` instead records an error in the cell that killed the kernel
(``KernelDied``: that cell earns nothing), starts a fresh kernel, replays the cells before it
(their outputs are kept from the first run) and carries on with the next cell. After
``max_restarts`` deaths the remaining cells are marked "not run". A cell that runs past the
per-cell timeout is interrupted (nbgrader's ``CellTimeoutError``) and the rest still run.

Each cell's wall time and every death go to a JSON report (``MINILLM_EXECUTE_REPORT``), which
the grader turns into the row's reason and the measured quick-mode time of a lab.

The throwaway grading course (grading.grader) and grading/nbgrader_config.py put it in
place of nbgrader's Execute in ``Autograde.autograde_preprocessors``.
"""

from __future__ import annotations

import copy
import json
import os
import time

from jupyter_core.utils import run_sync
from nbclient.exceptions import DeadKernelError
from nbformat.notebooknode import NotebookNode
from nbgrader.preprocessors import Execute
from traitlets import Integer, Unicode

REPORT_ENV = "MINILLM_EXECUTE_REPORT"


def _cell_name(cell, index: int) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id") or f"#{index}"  # "cell #12": the 13th cell


def _error(ename: str, evalue: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


class GradingExecute(Execute):
    max_restarts = Integer(2, help="kernel restarts per notebook before the remaining cells are skipped").tag(config=True)
    report_path = Unicode("", help=f"where to write the per-cell report (default: ${REPORT_ENV})").tag(config=True)

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
            result = await super().async_execute_cell(cell, cell_index, execution_count, store_history)
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
        """A fresh kernel with the state the notebook had before cell ``died_at``."""
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
                await Execute.async_execute_cell(self, replay, index, None, False)
            except DeadKernelError:
                self._gave_up_at = _cell_name(earlier, index)
                return
