"""Build labs/ (student copies) and solutions/ from the instructor masters in grading/source.

One source of truth per lab: ``grading/source/NN_topic/NN_topic.ipynb`` holds the solutions
(``### BEGIN SOLUTION`` / ``### END SOLUTION``), the visible tests and the hidden tests
(``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS``). From it this module writes

- ``labs/NN_topic.ipynb``: exactly what ``nbgrader generate_assignment`` releases (solutions
  replaced by nbgrader's stub, hidden tests removed, cells locked, checksums), outputs cleared;
- ``solutions/NN_topic.ipynb``: the master with the marker lines and the hidden tests removed,
  outputs cleared, nbgrader cell metadata kept (so a solution is also a valid submission).

Output is byte-deterministic, so CI can rebuild and compare::

    python -m grading.build           # write labs/ and solutions/ (from the repository root)
    python -m grading.build --check   # exit 1 and list the files that would change

nbgrader runs in a throwaway course directory (configured from grading/nbgrader_config.py),
so no gradebook or release folder lands in the repository. Before it runs, :func:`check_masters`
refuses (ValueError; exit 1 from the command) a master with a markdown ``$`` that JupyterLab would
typeset as LaTeX, an autograded test cell without a direct ``assert``, or a test cell that ends on
a value nbgrader would read as a partial score.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import inspect
import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parents[1]
GRADING_DIR = REPO_ROOT / "grading"
SOURCE_DIR = GRADING_DIR / "source"
COURSE_CONFIG = GRADING_DIR / "nbgrader_config.py"
LABS_DIRNAME = "labs"
SOLUTIONS_DIRNAME = "solutions"

LAB_NAME = re.compile(r"\d\d_[a-z0-9_]+")

# Regions cut out of the solutions, as nbgrader's own preprocessors find them (substring match).
SOLUTION_MARKERS = ("BEGIN SOLUTION", "END SOLUTION")
# A model answer to an explain question, in an ordinary markdown cell: kept (without the marker lines)
# in solutions/, replaced by MODEL_ANSWER_STUB in labs/ and in every course nbgrader sees (so neither a
# release nor a graded copy nor its feedback page shows it).
MODEL_ANSWER_MARKERS = ("BEGIN MODEL ANSWER", "END MODEL ANSWER")
MODEL_ANSWER_STUB = "YOUR ANSWER HERE"
REMOVED_REGIONS = (("BEGIN HIDDEN TESTS", "END HIDDEN TESTS"), ("BEGIN MARK SCHEME", "END MARK SCHEME"))
HIDDEN_BEGIN, HIDDEN_END = REMOVED_REGIONS[0]  # the hidden tests' markers, cut out of labs/ and solutions/
COURSE_ID = "minillm"

# Per-cell metadata that records a past session rather than the lab (nbconvert's ClearOutput
# drops the first two; JupyterLab writes "execution" timings when recording them is on).
TRANSIENT_CELL_METADATA = ("collapsed", "scrolled", "execution", "ExecuteTime")
# Notebook metadata that must not reach git: widget state can be megabytes.
TRANSIENT_NOTEBOOK_METADATA = ("widgets", "celltoolbar")
# The grader's metadata in a master (grading.grader, grading.references): kept out of labs/ and solutions/.
GRADING_METADATA = ("minillm",)


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


def hidden_line_numbers(source: str) -> set[int]:
    """1-based numbers of the lines of a test cell's hidden-test regions, marker lines included."""
    numbers, inside = set(), False
    for number, line in enumerate(source.split("\n"), 1):
        if HIDDEN_BEGIN in line:
            inside = True
        if inside:
            numbers.add(number)
        if HIDDEN_END in line:
            inside = False
    return numbers


def find_submissions(submissions_dir: Path) -> dict[str, dict[str, Path]]:
    """``SUBMISSIONS_DIR/<student_id>/<NN_topic>/<NN_topic>.ipynb`` as ``{student: {lab: path}}``
    (also nbgrader's own submitted/ folder). A lab folder without the notebook is listed too, with
    the missing path, so that student gets a row saying so."""
    submissions_dir = Path(submissions_dir)
    if not submissions_dir.is_dir():
        raise FileNotFoundError(f"no submissions folder at {submissions_dir}")
    found: dict[str, dict[str, Path]] = {}
    for lab_dir in sorted(submissions_dir.glob("*/*")):
        if not lab_dir.is_dir() or lab_dir.name.startswith(".") or lab_dir.parent.name.startswith("."):
            continue
        found.setdefault(lab_dir.parent.name, {})[lab_dir.name] = lab_dir / f"{lab_dir.name}.ipynb"
    return found


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
    """Drop outputs, execution counts, widget state, session metadata and the grader's own metadata
    (``minillm``: where each cell runs when graded, the references; in place)."""
    for key in (*TRANSIENT_NOTEBOOK_METADATA, *GRADING_METADATA):
        nb.metadata.pop(key, None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in (*TRANSIENT_CELL_METADATA, *GRADING_METADATA):
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
        if any(marker in line for marker in SOLUTION_MARKERS + MODEL_ANSWER_MARKERS):
            continue
        kept.append(line)
    if open_region is not None:
        raise ValueError(f"no '{open_region[1]}' after '{open_region[0]}' in cell:\n{source}")
    return "\n".join(kept)


def model_answer_regions(source: str) -> list[tuple[int, int]]:
    """(first, last) line indices of each ``### BEGIN MODEL ANSWER`` ... ``### END MODEL ANSWER`` region
    of one cell, markers included; ValueError for a region left open or an END without a BEGIN."""
    regions, start = [], None
    begin, end = MODEL_ANSWER_MARKERS
    for index, line in enumerate(source.split("\n")):
        if begin in line:
            if start is not None:
                raise ValueError(f"'{begin}' inside another model answer:\n{source}")
            start = index
        elif end in line:
            if start is None:
                raise ValueError(f"'{end}' without a '{begin}':\n{source}")
            regions.append((start, index))
            start = None
    if start is not None:
        raise ValueError(f"no '{end}' after '{begin}' in cell:\n{source}")
    return regions


def without_model_answers(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` whose model answers are replaced by MODEL_ANSWER_STUB: the notebook that nbgrader
    releases, grades and turns into feedback."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        regions = model_answer_regions(cell.source)
        if not regions:
            continue
        lines = cell.source.split("\n")
        for first, last in reversed(regions):
            lines[first:last + 1] = [MODEL_ANSWER_STUB]
        cell.source = "\n".join(lines)
    return nb


def solution_notebook(master: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The solved lab: the master without marker lines, hidden tests or mark schemes."""
    nb = copy.deepcopy(master)
    for cell in nb.cells:
        cell.source = _cut_regions(cell.source)
    return clean(nb)


# ------------------------------------------------------------------ checks on the masters
# JupyterLab hides code from its math finder the way this does (rendermime's removeMath): fenced
# blocks of 3+ backticks or tildes, and code spans on one line.
_FENCED_CODE = re.compile(r"^(?P<fence>`{3,}|~{3,})[^`\n]*\n[\s\S]*?^(?P=fence)`*$", re.MULTILINE)
_CODE_SPAN = re.compile(r"(^|[^\\])(`+)([^\n]*?[^`\n])\2(?!`)", re.MULTILINE)
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
_MASK = "\0"


def _mask_code(text: str) -> str:
    """``text`` with every ``$`` inside fenced code and code spans replaced (same length)."""
    text = _FENCED_CODE.sub(lambda m: m.group(0).replace("$", _MASK), text)
    # group 1 is the character before a span's backticks: not code, kept as it is
    return _CODE_SPAN.sub(lambda m: m.group(1) + m.group(0)[len(m.group(1)):].replace("$", _MASK), text)


def _display_math_end(text: str, start: int) -> int | None:
    """Index of the ``$$`` that closes display math opened just before ``start``; None when a
    paragraph break (a blank line) or the end of the cell comes first."""
    i = start
    while i < len(text):
        if text.startswith("\\$", i):
            i += 2
        elif text.startswith("$$", i):
            return i
        elif _BLANK_LINE.match(text, i):
            return None
        else:
            i += 1
    return None


def markdown_math_dollars(source: str) -> list[tuple[int, str]]:
    r"""The ``$`` signs of one markdown cell that JupyterLab could typeset as LaTeX, as
    ``(line number from 1, why)``; empty when every dollar is literal or deliberate display math.

    How JupyterLab 4 renders a markdown cell: its math finder (rendermime's ``removeMath``) cuts out
    ``$...$`` and ``$$...$$`` spans that close within one paragraph, on one line or across lines;
    marked renders the rest (turning ``\$`` into a bare ``$``); then MathJax typesets the page, and
    it too pairs any two bare ``$`` in one paragraph. So ``0.55 $/Mtok and 2.50 $/h`` renders
    ``/Mtok and 2.50`` as italic math, and ``0.55 \$/Mtok and 2.50 \$/h`` does the same (both
    checked in JupyterLab 4.6 with headless Chromium). A dollar that stays literal is written
    ``\\$``: the math finder skips the escaped dollar, marked leaves ``\$``, and MathJax
    (``processEscapes``) prints ``$``. nbconvert's HTML (nbgrader's feedback) works the same way:
    mistune, like marked, turns ``\$`` into ``$`` and ``\\$`` into ``\$``, for a MathJax set to
    ``processEscapes``.

    The rule, on the cell with fenced code blocks and one-line code spans left out (JupyterLab
    never typesets those):

    - ``\\$`` (two or more backslashes before the ``$``) is a literal dollar: fine;
    - ``$$ ... $$`` closed before a blank line is display math: fine, its content is not read;
    - a ``$$`` that nothing closes in its paragraph is reported;
    - every other ``$`` — bare or ``\$`` — is reported, paired or not: a lone one renders as a
      dollar only until someone adds another to the paragraph. Inline math, if ever needed, is
      written ``\\( ... \\)``, which the math finder and MathJax also read.
    """
    text = _mask_code(source)
    problems: list[tuple[int, str]] = []

    def report(index: int, why: str) -> None:
        problems.append((text.count("\n", 0, index) + 1, why))

    i = 0
    while i < len(text):
        if text[i] == "\\":
            j = i
            while j < len(text) and text[j] == "\\":
                j += 1
            if j < len(text) and text[j] == "$":
                if j - i == 1:
                    report(j, "`\\$` reaches MathJax as a bare `$` (Markdown eats the backslash): write `\\\\$`")
                i = j + 1
            else:
                i = j
        elif text.startswith("$$", i):
            end = _display_math_end(text, i + 2)
            if end is None:
                report(i, "`$$` opens display math that nothing closes in its paragraph")
                i += 2
            else:
                i = end + 2
        elif text[i] == "$":
            report(i, "a bare `$` pairs with any other in its paragraph as LaTeX: write `\\\\$` for a dollar sign")
            i += 1
        else:
            i += 1
    return problems


def _is_autograded_test(cell) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return cell.cell_type == "code" and bool(meta.get("grade")) and not meta.get("solution")


def _import_aliases(nb) -> dict[str, str]:
    """Names the master's code cells import, as ``{name: dotted path}`` (``lab02`` ->
    ``minillm.lab.lab02``)."""
    aliases: dict[str, str] = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _dotted_name(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _resolve(dotted: str):
    """The object a dotted path names (importing the longest module prefix); None if none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _returns_none(fn) -> bool:
    """Whether ``fn`` is annotated ``-> None`` (a string under ``from __future__ import annotations``)."""
    try:
        annotation = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return False
    return annotation is None or annotation is type(None) or annotation == "None"


def _last_value_problem(tree: ast.Module, aliases: dict[str, str]) -> str | None:
    """Why the value the cell ends on would reach nbgrader (None when it cannot)."""
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return None
    value = tree.body[-1].value
    code = ast.unparse(value)
    if not isinstance(value, ast.Call):
        return f"it ends on the expression `{code}`, whose value nbgrader would read as a partial score"
    name = _dotted_name(value.func)
    if name == "print":
        return None
    head, _, rest = (name or "").partition(".")
    fn = _resolve(aliases[head] + (f".{rest}" if rest else "")) if name and head in aliases else None
    if fn is None:
        return (f"it ends on `{code}`, a call this build cannot trace to an imported function annotated `-> None`; "
                "nbgrader reads the value a test cell ends on as a partial score")
    if not _returns_none(fn):
        return (f"it ends on `{code}`, and {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', name)} is not "
                "annotated `-> None`: nbgrader reads the value a test cell ends on as a partial score (a helper "
                "prints its verdict and returns None)")
    return None


def autograded_cell_problems(lab: str, nb) -> list[str]:
    """What is wrong with the autograded test cells of one master (code cells with nbgrader
    ``grade: true``), one sentence each, naming the lab and the grade_id:

    - the visible part (what a learner sees: hidden tests cut out) has no ``assert`` statement:
      a cell that only calls a ``labNN.check_*`` helper passes when the learner monkeypatches the
      helper away, so every test cell also asserts on the learner's result itself;
    - the cell, as the learner runs it or as the autograder runs it (hidden tests restored), ends
      on an expression statement: nbgrader takes the value a test cell ends on (its
      execute_result) as a partial score. A call is allowed when it is ``print`` or a function the
      master imports that is annotated ``-> None`` (checked on the imported lab module).
    """
    problems: list[str] = []
    aliases: dict[str, str] | None = None
    for cell in nb.cells:
        if not _is_autograded_test(cell):
            continue
        grade_id = cell.metadata["nbgrader"].get("grade_id", cell.get("id"))
        where = f"{lab}: test cell {grade_id} (cell {cell.get('id')})"
        try:
            graded = ast.parse(cell.source)
            visible = ast.parse(_cut_regions(cell.source))
        except SyntaxError as error:
            problems.append(f"{where} does not parse as Python: {error}")
            continue
        if not any(isinstance(node, ast.Assert) for node in ast.walk(visible)):
            problems.append(f"{where} has no `assert` before '### BEGIN HIDDEN TESTS': assert on the learner's result "
                            "in the cell itself (a check_* helper alone can be monkeypatched away)")
        if aliases is None:
            aliases = _import_aliases(nb)
        seen = set()
        for part, tree in (("as the learner runs it", visible), ("with the hidden tests", graded)):
            why = _last_value_problem(tree, aliases)
            if why and why not in seen:
                seen.add(why)
                problems.append(f"{where}, {part}: {why}")
    return problems


def markdown_problems(lab: str, nb) -> list[str]:
    """Every markdown ``$`` of one master that JupyterLab could typeset as LaTeX (see
    :func:`markdown_math_dollars`), naming the lab, the cell id and the line."""
    problems = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        lines = cell.source.split("\n")
        for line_number, why in dict.fromkeys(markdown_math_dollars(cell.source)):
            problems.append(f"{lab}: markdown cell {cell.get('id')}, line {line_number}: {why}:\n"
                            f"      {lines[line_number - 1]}")
    return problems


def model_answer_problems(lab: str, nb) -> list[str]:
    """Model answers belong in plain markdown cells (nbgrader's own cells have their own markers)."""
    problems = []
    for index, cell in enumerate(nb.cells):
        try:
            regions = model_answer_regions(cell.source)
        except ValueError as error:
            problems.append(f"{lab} cell {index}: {str(error).splitlines()[0]}")
            continue
        if regions and (cell.cell_type != "markdown" or "nbgrader" in cell.metadata):
            problems.append(f"{lab} cell {index}: a model answer belongs in a markdown cell without nbgrader metadata")
    return problems


def grading_metadata_problems(lab: str, nb) -> list[str]:
    """The grader's metadata in a master (grading/README.md, "What a score is worth"): each locked code
    cell's ``runs_in``, the references each exercise rebuilds (they must exist), the kernel exercises."""
    from grading import references

    problems = []
    for cell in nb.cells:
        where = cell.metadata.get("minillm", {}).get("runs_in")
        if where is not None:
            if where not in ("both", "sandbox", "grader"):
                problems.append(f"{lab}: cell {cell.get('id')}: runs_in={where!r}, not one of 'both', 'sandbox', 'grader'")
            if cell.cell_type != "code" or cell.metadata.get("nbgrader", {}).get("solution") \
                    or cell.metadata.get("nbgrader", {}).get("grade"):
                problems.append(f"{lab}: cell {cell.get('id')}: runs_in is for locked code cells, not solution or test cells")
    problems += references.problems(lab, nb)
    solutions = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in nb.cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    for grade_id, names in nb.metadata.get("minillm", {}).get("kernels", {}).items():
        cell = solutions.get(grade_id)
        if cell is None or not all(f"def {name}(" in cell.source for name in names):
            problems.append(f"{lab}: kernels: {grade_id} is no solution cell defining {names}")
    return problems


def check_masters(labs: list[str], source_dir: Path = SOURCE_DIR) -> None:
    """Raise ValueError listing every problem :func:`markdown_problems` and
    :func:`autograded_cell_problems` find in the masters of ``labs``."""
    problems: list[str] = []
    for lab in labs:
        nb = read_master(lab, source_dir)
        problems += (markdown_problems(lab, nb) + autograded_cell_problems(lab, nb) + model_answer_problems(lab, nb)
                     + grading_metadata_problems(lab, nb))
    if problems:
        raise ValueError(f"{len(problems)} problem(s) in grading/source; fix the masters, then run `make labs`:\n"
                         + "\n".join(f"  {problem}" for problem in problems))


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
                destination.write_text(dumps(without_model_answers(read_master(lab, source_dir))), encoding="utf-8")
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
    """Every generated file as ``{path relative to the repository root: text}``; ValueError first
    when a master fails :func:`check_masters`."""
    labs = discover_labs(source_dir) if labs is None else labs
    check_masters(labs, source_dir)
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
    labs: list[str] | None = None,
) -> list[str]:
    """Regenerate labs/ and solutions/ under ``out_root``; return the paths that changed
    (with ``check=True``: that would change) — written, differing, or stale (no master left).
    ``rendered``: the output of :func:`render`, to reuse one rendering; ``labs``: only these labs
    (the others' files are neither written nor removed)."""
    out_root = Path(out_root)
    if rendered is None:
        rendered = render(source_dir) if labs is None else render(source_dir, labs)
    if labs is not None:
        return _write(out_root, rendered, check)
    changed = _write(out_root, rendered, check)
    for relative in sorted(_generated_files_present(out_root) - set(rendered)):
        changed.append(relative)
        if not check:
            (out_root / relative).unlink()
    return changed


def _write(out_root: Path, rendered: dict[str, str], check: bool) -> list[str]:
    """Write each rendered file that differs (unless ``check``); the paths that differ."""
    changed: list[str] = []
    for relative, text in sorted(rendered.items()):
        path = out_root / relative
        if path.is_file() and path.read_bytes() == text.encode("utf-8"):
            continue
        changed.append(relative)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grading.build", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any file would change")
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root that holds labs/ and solutions/")
    parser.add_argument("--source", type=Path, default=SOURCE_DIR, help="folder of instructor masters")
    parser.add_argument("--labs", nargs="+", metavar="LAB", help="only these labs (e.g. 06_prefix_caching)")
    args = parser.parse_args(argv)

    labs = discover_labs(args.source)
    if args.labs:
        unknown = sorted(set(args.labs) - set(labs))
        if unknown:
            print(f"no master for {unknown}; the labs are {', '.join(labs)}", file=sys.stderr)
            return 1
        labs = [lab for lab in labs if lab in args.labs]
    if not labs:
        print(f"no masters found under {args.source} (expected NN_topic/NN_topic.ipynb)", file=sys.stderr)
        return 1
    try:
        changed = build(args.out, args.source, check=args.check, labs=labs if args.labs else None)
    except ValueError as error:  # a master fails check_masters: say what, no traceback
        print(error, file=sys.stderr)
        return 1
    if args.check:
        if changed:
            print("generated notebooks differ from their masters; run `make labs` (python -m grading.build):")
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
