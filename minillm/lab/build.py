"""Build labs/ (student copies) and solutions/ from the instructor masters in grading/source.

One source of truth per lab: ``grading/source/NN_topic/NN_topic.ipynb`` holds the solutions
(``### BEGIN SOLUTION`` / ``### END SOLUTION``), the visible tests and the hidden tests
(``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS``). From it this module writes

- ``labs/NN_topic.ipynb``: exactly what ``nbgrader generate_assignment`` releases (solutions
  replaced by nbgrader's stub, hidden tests removed, cells locked, checksums), outputs cleared;
- ``solutions/NN_topic.ipynb``: the master with the marker lines and the hidden tests removed,
  outputs cleared, nbgrader cell metadata kept (so a solution is also a valid submission).

Output is byte-deterministic, so CI can rebuild and compare::

    python -m minillm.lab.build           # write labs/ and solutions/
    python -m minillm.lab.build --check   # exit 1 and list the files that would change

nbgrader runs in a throwaway course directory (configured from grading/nbgrader_config.py),
so no gradebook or release folder lands in the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parents[2]
GRADING_DIR = REPO_ROOT / "grading"
SOURCE_DIR = GRADING_DIR / "source"
COURSE_CONFIG = GRADING_DIR / "nbgrader_config.py"
LABS_DIRNAME = "labs"
SOLUTIONS_DIRNAME = "solutions"

LAB_NAME = re.compile(r"\d\d_[a-z0-9_]+")

# Regions cut out of the solutions, as nbgrader's own preprocessors find them (substring match).
SOLUTION_MARKERS = ("BEGIN SOLUTION", "END SOLUTION")
REMOVED_REGIONS = (("BEGIN HIDDEN TESTS", "END HIDDEN TESTS"), ("BEGIN MARK SCHEME", "END MARK SCHEME"))

# Per-cell metadata that records a past session rather than the lab (nbconvert's ClearOutput
# drops the first two; JupyterLab writes "execution" timings when recording them is on).
TRANSIENT_CELL_METADATA = ("collapsed", "scrolled", "execution", "ExecuteTime")
# Notebook metadata that must not reach git: widget state can be megabytes.
TRANSIENT_NOTEBOOK_METADATA = ("widgets", "celltoolbar")


def discover_labs(source_dir: Path = SOURCE_DIR) -> list[str]:
    """Lab names (``NN_topic``) that have a master ``source/NN_topic/NN_topic.ipynb``, sorted."""
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        return []
    return sorted(
        entry.name
        for entry in source_dir.iterdir()
        if LAB_NAME.fullmatch(entry.name) and (entry / f"{entry.name}.ipynb").is_file()
    )


def read_master(lab: str, source_dir: Path = SOURCE_DIR) -> nbformat.NotebookNode:
    """The master of one lab, in nbformat 4.5 with a stable id on every cell."""
    nb = nbformat.read(Path(source_dir) / lab / f"{lab}.ipynb", as_version=4)
    # nbformat would give id-less cells random ids on upgrade; ids derived from the position
    # keep the output deterministic (masters written by JupyterLab already carry ids).
    nb.nbformat_minor = max(nb.nbformat_minor, 5)
    for index, cell in enumerate(nb.cells):
        if not cell.get("id"):
            cell["id"] = f"cell-{index}"
    return nb


def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop outputs, execution counts, widget state and session metadata (in place)."""
    for key in TRANSIENT_NOTEBOOK_METADATA:
        nb.metadata.pop(key, None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in TRANSIENT_CELL_METADATA:
            cell.metadata.pop(key, None)
    return nb


def dumps(nb: nbformat.NotebookNode) -> str:
    """Serialize the way nbformat.write does (indent 1, sorted keys, trailing newline), after
    normalizing and validating, so equal notebooks give equal bytes."""
    _, normalized = nbformat.validator.normalize(nb)
    normalized = nbformat.from_dict(normalized)
    nbformat.validate(normalized)
    text = nbformat.writes(normalized, version=4)
    return text if text.endswith("\n") else text + "\n"


def _cut_regions(source: str) -> str:
    """Remove solution marker lines and hidden-test / mark-scheme regions from one cell."""
    kept: list[str] = []
    open_region: tuple[str, str] | None = None
    for line in source.split("\n"):
        if open_region is not None:
            if open_region[1] in line:
                open_region = None
            continue
        region = next((r for r in REMOVED_REGIONS if r[0] in line), None)
        if region is not None:
            open_region = region
            continue
        if any(marker in line for marker in SOLUTION_MARKERS):
            continue
        kept.append(line)
    if open_region is not None:
        raise ValueError(f"no '{open_region[1]}' after '{open_region[0]}' in cell:\n{source}")
    return "\n".join(kept)


def solution_notebook(master: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The solved lab: the master without marker lines, hidden tests or mark schemes."""
    nb = copy.deepcopy(master)
    for cell in nb.cells:
        cell.source = _cut_regions(cell.source)
    return clean(nb)


def write_course_config(course_root: Path) -> Path:
    """Write ``nbgrader_config.py`` for a throwaway course at ``course_root`` that loads the
    repository's course config and points root and gradebook at ``course_root``."""
    if not COURSE_CONFIG.is_file():
        raise FileNotFoundError(f"course config missing: {COURSE_CONFIG}")
    course_root = Path(course_root)
    db_path = course_root / "gradebook.db"
    config_path = course_root / "nbgrader_config.py"
    config_path.write_text(
        "c = get_config()  # noqa: F821\n"
        f"load_subconfig({str(COURSE_CONFIG)!r})  # noqa: F821\n"
        f"c.CourseDirectory.root = {str(course_root)!r}\n"
        f"c.CourseDirectory.db_url = {'sqlite:///' + str(db_path)!r}\n",
        encoding="utf-8",
    )
    return config_path


def make_course(course_root: Path, labs: list[str], source_dir: Path = SOURCE_DIR) -> Path:
    """A throwaway nbgrader course at ``course_root`` holding the (id-normalized) masters.

    Files next to a master (data, helper modules) are copied too: nbgrader releases them.
    """
    course_root = Path(course_root)
    course_root.mkdir(parents=True, exist_ok=True)
    write_course_config(course_root)
    for lab in labs:
        lab_source = Path(source_dir) / lab
        target = course_root / "source" / lab
        target.mkdir(parents=True, exist_ok=True)
        for path in sorted(lab_source.rglob("*")):
            relative = path.relative_to(lab_source)
            if path.is_dir() or any(part in {".ipynb_checkpoints", "__pycache__"} for part in relative.parts):
                continue
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            if relative == Path(f"{lab}.ipynb"):
                destination.write_text(dumps(read_master(lab, source_dir)), encoding="utf-8")
            else:
                destination.write_bytes(path.read_bytes())
    return course_root


@contextlib.contextmanager
def nbgrader_on_path():
    """Put this interpreter's scripts folder on PATH while nbgrader runs: creating a gradebook
    shells out to ``alembic``, which is not on PATH when the venv is not activated."""
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), previous])
    try:
        yield
    finally:
        os.environ["PATH"] = previous


def load_course_config(course_root: Path):
    """The traitlets Config of a course made by :func:`make_course`."""
    from traitlets.config.loader import PyFileConfigLoader

    return PyFileConfigLoader("nbgrader_config.py", path=str(course_root)).load_config()


def generate_assignments(course_root: Path, labs: list[str]) -> dict[str, Path]:
    """Run nbgrader generate_assignment (in process) for each lab; return release notebooks.

    This also registers the labs, their graded cells and the hidden tests in the course's
    gradebook, which is what autograding later reads.
    """
    from nbgrader.converters import GenerateAssignment
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.utils import capture_log

    config = load_course_config(course_root)
    released: dict[str, Path] = {}
    for lab in labs:
        coursedir = CourseDirectory(config=config)
        coursedir.assignment_id = lab
        app = GenerateAssignment(coursedir=coursedir, config=config)
        app.force = True
        app.create_assignment = True
        with nbgrader_on_path():
            result = capture_log(app)
        if not result["success"]:
            raise RuntimeError(
                f"nbgrader generate_assignment failed for {lab}:\n{result.get('log', '')}\n{result['error']}"
            )
        released[lab] = Path(course_root) / coursedir.release_directory / lab / f"{lab}.ipynb"
        if not released[lab].is_file():
            raise RuntimeError(f"nbgrader generate_assignment produced no {released[lab]}")
    return released


def render(source_dir: Path = SOURCE_DIR, labs: list[str] | None = None) -> dict[str, str]:
    """Every generated file as ``{path relative to the repository root: text}``."""
    labs = discover_labs(source_dir) if labs is None else labs
    rendered: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="minillm-build-") as tmp:
        course_root = make_course(Path(tmp) / "course", labs, source_dir)
        released = generate_assignments(course_root, labs)
        for lab in labs:
            student = clean(nbformat.read(released[lab], as_version=4))
            rendered[f"{LABS_DIRNAME}/{lab}.ipynb"] = dumps(student)
            rendered[f"{SOLUTIONS_DIRNAME}/{lab}.ipynb"] = dumps(solution_notebook(read_master(lab, source_dir)))
    return rendered


def _generated_files_present(out_root: Path) -> set[str]:
    present = set()
    for dirname in (LABS_DIRNAME, SOLUTIONS_DIRNAME):
        for path in (Path(out_root) / dirname).glob("*.ipynb"):
            if LAB_NAME.fullmatch(path.stem):
                present.add(f"{dirname}/{path.name}")
    return present


def build(
    out_root: Path = REPO_ROOT,
    source_dir: Path = SOURCE_DIR,
    check: bool = False,
    rendered: dict[str, str] | None = None,
) -> list[str]:
    """Regenerate labs/ and solutions/ under ``out_root``; return the paths that changed
    (with ``check=True``: that would change) — written, differing, or stale (no master left).
    ``rendered``: the output of :func:`render`, to reuse one rendering."""
    out_root = Path(out_root)
    rendered = render(source_dir) if rendered is None else rendered
    changed: list[str] = []
    for relative, text in sorted(rendered.items()):
        path = out_root / relative
        if path.is_file() and path.read_bytes() == text.encode("utf-8"):
            continue
        changed.append(relative)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
    for relative in sorted(_generated_files_present(out_root) - set(rendered)):
        changed.append(relative)
        if not check:
            (out_root / relative).unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.lab.build", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any file would change")
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root that holds labs/ and solutions/")
    parser.add_argument("--source", type=Path, default=SOURCE_DIR, help="folder of instructor masters")
    args = parser.parse_args(argv)

    labs = discover_labs(args.source)
    if not labs:
        print(f"no masters found under {args.source} (expected NN_topic/NN_topic.ipynb)", file=sys.stderr)
        return 1
    changed = build(args.out, args.source, check=args.check)
    if args.check:
        if changed:
            print("generated notebooks differ from their masters; run `make labs` (python -m minillm.lab.build):")
            for relative in changed:
                print(f"  {relative}")
            return 1
        print(f"labs/ and solutions/ are up to date ({len(labs)} labs: {', '.join(labs)})")
        return 0
    for relative in changed:
        print(f"wrote {relative}" if (args.out / relative).exists() else f"removed {relative}")
    print(f"{len(labs)} labs built, {len(changed)} files changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
