"""What a lab's exercises rebuild is not reachable from the sandbox: the references, stubbed.

Each master declares, per exercise, the implementations a learner could call instead of writing their own
(the lab helper's ``reference_*`` functions, the engine's own implementation of that part, torch operators a
check bans), in its notebook metadata::

    "minillm": {"references": {
        "attend_with_cache": ["minillm.lab.lab02:reference_attend",             # a function
                              "minillm.layers.attention:TorchAttentionBackend",  # every method of a class
                              "minillm.kernels.attention:*",                     # every function of a module
                              "aten::scaled_dot_product_attention"]}}            # a torch operator

For the sandbox, :func:`prepare` copies the ``minillm`` package (without the C kernels' source: the
sandbox runs with ``MINILLM_CPU_KERNELS=0``) and rewrites each declared function's body into a call that
raises ``ReferenceUnavailable`` naming the exercise; a function of another installed package (torch,
transformers) is rewritten in a copy of its file that the sandbox sees in place of the original. The
original source is nowhere in the sandbox, so no route through Python reaches it. Torch operators are
refused at the dispatcher (grading.sandbox_runner), which every route to them goes through.

Besides what a master declares, every lab's sandbox has the grading helpers of every lab helper module
(``minillm.lab.*``) stubbed, without a declaration (:func:`grading_only`): each ``check_*`` function, which
would tell a loop over candidate answers which one is right, and each helper that computes an expected
answer (``reference_*``, ``*_reference``, ``expected_*``, and every ``minillm.lab`` function any master
declares for an exercise) unless the lab's own sandbox code (its solution cells and the locked cells that
run there) reaches it.

The grader itself keeps the real implementations: its checks compare against them.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

REFERENCE_MODULE = '''"""Raised by the references a lab's exercises rebuild, in the sandbox (written by grading.references)."""

USED = []


class ReferenceUnavailable(RuntimeError):
    """A reference implementation of the lever this lab asks you to build."""


def refuse(name, message):
    USED.append(name)
    raise ReferenceUnavailable(message)
'''

# Torch operators that compute attention (a check that bans scaled_dot_product_attention bans these:
# every one reaches the same kernels).
OPERATOR_FAMILIES = {
    "aten::scaled_dot_product_attention": [
        "aten::scaled_dot_product_attention@CompositeImplicitAutograd",
        "aten::_scaled_dot_product_attention_math@CompositeImplicitAutograd",
        "aten::_scaled_dot_product_flash_attention_for_cpu@CPU",
        "aten::_scaled_dot_product_flash_attention@CUDA",
        "aten::_scaled_dot_product_efficient_attention@CUDA",
        "aten::_scaled_dot_product_cudnn_attention@CUDA",
        "aten::_native_multi_head_attention@CPU",
        "aten::_native_multi_head_attention@CUDA",
    ],
}


@dataclass
class SandboxLibrary:
    """What the sandbox of one lab sees instead of the originals."""

    package_binds: list[tuple[str, str]] = field(default_factory=list)  # (prepared path, original path)
    bans: dict[str, str] = field(default_factory=dict)                  # operator@key -> message
    runner_dir: Path | None = None
    stubbed: list[str] = field(default_factory=list)                    # "module:qualname" rewritten


def declared(master) -> dict[str, list[str]]:
    """``{exercise grade_id: [reference, ...]}`` from a master's metadata (empty when it declares none)."""
    meta = master.metadata.get("minillm", {}) if hasattr(master, "metadata") else {}
    references = meta.get("references", {}) if isinstance(meta, dict) else {}
    if not isinstance(references, dict):
        raise ValueError("metadata.minillm.references must map exercise grade_ids to lists of references")
    return {str(k): [str(r) for r in v] for k, v in references.items()}


def problems(lab: str, master) -> list[str]:
    """What is wrong with a master's declared references: an unknown exercise, a module or name that
    does not exist (checked without importing the module's code)."""
    found = []
    exercises = {c.metadata.get("nbgrader", {}).get("grade_id") for c in master.cells
                 if c.metadata.get("nbgrader", {}).get("solution")}
    references = declared(master)
    found += [f"{lab}: references of {exercise!r}, which is not a solution cell" for exercise in references
              if exercise not in exercises]
    for _, ref, module, qualname, path in _python_references(references):
        if path is None:
            found.append(f"{lab}: reference {ref!r}: no module {module}")
        elif qualname != "*" and not _find(ast.parse(path.read_text(encoding="utf-8")), qualname.split(".")):
            found.append(f"{lab}: reference {ref!r}: {module} defines no {qualname}")
    return found


def _python_references(references: dict[str, list[str]]):
    """(exercise, reference, module, qualname, the module's file or None) of each Python reference."""
    for exercise, refs in references.items():
        for ref in refs:
            if not ref.startswith("aten::"):
                module, _, qualname = ref.partition(":")
                yield exercise, ref, module, qualname, _module_file(module)


def _module_file(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _find(tree, path: list[str]):
    body = tree.body
    node = None
    for part in path:
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def _stub_body(node, name: str, message: str) -> None:
    keep = node.body[:1] if (node.body and isinstance(node.body[0], ast.Expr)
                              and isinstance(getattr(node.body[0], "value", None), ast.Constant)
                              and isinstance(node.body[0].value.value, str)) else []
    call = ast.parse(f"__import__('_minillm_reference').refuse({name!r}, {message!r})").body
    node.body = keep + call


def _stub(node, name: str, message: str) -> list[str]:
    """Rewrite a function, or every function and method under a class or module node."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        _stub_body(node, name, message)
        return [name]
    done = []
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            done += _stub(child, f"{name}.{child.name}", message)
    return done


def _message(lab: str, exercise: str, name: str) -> str:
    return (f"{name} is not available while {lab} is graded: exercise {exercise} asks you to build it "
            "(your own code must do the work; the grader compares it with the reference outside the sandbox)")


def _check_message(lab: str, name: str) -> str:
    return (f"{name} is one of the grader's checks: while {lab} is graded it runs only outside the sandbox, on your "
            "answers (test your code with your own asserts)")


def _answer_message(lab: str, name: str) -> str:
    return (f"{name} computes answers the grader compares with: while {lab} is graded it is not available in the "
            "sandbox (your own code must do the work)")


def _rewrite(source: str, targets: list[tuple[str, object]], module: str) -> tuple[str, list[str]]:
    """``targets``: (qualname, why) with ``why`` an exercise's (exercise, lab) or a function of the stub's name
    that gives its message."""
    tree = ast.parse(source)
    done = []
    for qualname, why in targets:
        node = tree if qualname == "*" else _find(tree, qualname.split("."))
        if node is None:
            raise ValueError(f"reference {module}:{qualname} ({why if isinstance(why, tuple) else 'automatic'}) "
                             "does not exist")
        prefix = module if qualname == "*" else f"{module}.{qualname}"
        message = _message(why[1], why[0], prefix) if isinstance(why, tuple) else why(prefix)
        done += _stub(node, prefix, message)
    return ast.unparse(tree) + "\n", done


# --------------------------------------------------------------------------- grading helpers, by rule
LAB_PACKAGE = "minillm.lab"
CHECK_NAME = re.compile(r"^check_")
ANSWER_NAME = re.compile(r"^(reference_|expected_|_expected|_ref_|_check_)|_reference$")


def _lab_trees(package: Path) -> dict[str, ast.Module]:
    """{module name: its syntax tree} of every lab helper module (``minillm/lab/*.py``) under ``package``."""
    paths = sorted(path for path in (Path(package) / "lab").glob("*.py") if path.stem != "__init__")
    return _parsed(tuple((str(path), path.stat().st_mtime_ns) for path in paths))


@functools.lru_cache(maxsize=4)
def _parsed(files: tuple[tuple[str, int], ...]) -> dict[str, ast.Module]:
    return {f"{LAB_PACKAGE}.{Path(path).stem}": ast.parse(Path(path).read_text(encoding="utf-8")) for path, _ in files}


def _names(nodes) -> set[str]:
    """Every name and attribute name the nodes mention (a call of ``lab01.f`` or of ``f``: ``f``)."""
    found: set[str] = set()
    for node in nodes:
        if node is None:
            continue
        for child in ast.walk(node):
            if isinstance(child, ast.Name):
                found.add(child.id)
            elif isinstance(child, ast.Attribute):
                found.add(child.attr)
    return found


def _import_time(function) -> list:
    """What of a def runs when its module is imported: decorators and default values."""
    args = function.args
    return [*function.decorator_list, *args.defaults, *[d for d in args.kw_defaults if d is not None]]


def _call_graph(trees: dict[str, ast.Module]) -> tuple[dict[str, set[str]], set[str]]:
    """({top-level def or class name: the names its body mentions}, the names mentioned by what runs at import).
    Names stand for every def of that name in any lab module: a reach is over-counted, never missed."""
    graph: dict[str, set[str]] = {}
    at_import: set[str] = set()
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                graph.setdefault(node.name, set()).update(_names([node]))
                at_import |= _names(_import_time(node))
            elif isinstance(node, ast.ClassDef):
                graph.setdefault(node.name, set()).update(_names([node]))
                at_import |= _names([*node.bases, *node.keywords, *node.decorator_list])
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        at_import |= _names(_import_time(item))
                    else:
                        at_import |= _names([item])
            else:
                at_import |= _names([node])
    return graph, at_import


def sandbox_sources(master) -> list[str]:
    """The master's code that runs in the sandbox: its solution cells (the model answers) and the locked cells
    whose ``runs_in`` is "both" (the default) or "sandbox"; never a test cell."""
    sources = []
    for cell in master.cells:
        if cell.cell_type != "code":
            continue
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution"):
            continue
        if meta.get("solution") or cell.metadata.get("minillm", {}).get("runs_in", "both") in ("both", "sandbox"):
            sources.append(cell.source)
    return sources


def reached(sources: list[str], package: Path | None = None) -> set[str]:
    """The names of lab helpers that ``sources`` (notebook code) can reach, through the helpers' own calls."""
    graph, at_import = _call_graph(_lab_trees(package or _package()))
    todo = set(at_import)
    for source in sources:
        try:
            todo |= _names([ast.parse(source)])
        except SyntaxError:
            continue
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo |= graph.get(name, set()) - seen
    return seen


def _package() -> Path:
    import minillm

    return Path(minillm.__file__).resolve().parent


COURSE_MASTERS = Path(__file__).resolve().parent / "source"   # the course's masters (grading.build's SOURCE_DIR)


@functools.lru_cache(maxsize=4)
def _declared_lab_helpers(source_dir: Path = COURSE_MASTERS) -> frozenset[tuple[str, str]]:
    """(module, function) of every ``minillm.lab`` function the course's masters declare for an exercise (their
    notebook metadata, read as JSON)."""
    found: set[tuple[str, str]] = set()
    for path in sorted(Path(source_dir).glob("*/*.ipynb")):
        try:
            meta = json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
        except (OSError, ValueError):
            continue
        found |= _lab_functions(meta.get("minillm", {}).get("references", {}) or {})
    return frozenset(found)


def _lab_functions(references: dict) -> set[tuple[str, str]]:
    """(module, function) of the ``minillm.lab`` module-level functions among declared references."""
    found = set()
    for refs in references.values():
        for ref in refs:
            module, _, qualname = str(ref).partition(":")
            if module.startswith(LAB_PACKAGE + ".") and qualname and "." not in qualname and qualname != "*":
                found.add((module, qualname))
    return found


def grading_only(lab: str, master=None, package: Path | None = None) -> list[tuple[str, str, object]]:
    """The lab helpers stubbed in ``lab``'s sandbox whatever its master declares: (module, function, message
    maker). Every ``check_*`` function of every ``minillm.lab`` module; and every one that computes an expected
    answer or checks one case (``reference_*``, ``*_reference``, ``expected_*``, ``_ref_*``, ``_check_*``, or
    declared for an exercise by any course master or by ``master``) unless the lab's sandbox code reaches it
    (``master``'s solution cells and the locked cells that run in the sandbox; without a master, none is taken
    to)."""
    package = package or _package()
    trees = _lab_trees(package)
    declared_anywhere = _declared_lab_helpers() | _lab_functions(declared(master) if master is not None else {})
    reachable = reached(sandbox_sources(master), package) if master is not None else set()
    found = []
    for module, tree in trees.items():
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            name = node.name
            if CHECK_NAME.match(name):
                found.append((module, name, lambda prefix: _check_message(lab, prefix)))
            elif ((ANSWER_NAME.search(name) and not name.startswith("print_")) or (module, name) in declared_anywhere) \
                    and name not in reachable:
                found.append((module, name, lambda prefix: _answer_message(lab, prefix)))
    return found


def prepare(lab: str, references: dict[str, list[str]], out_dir: Path, master=None) -> SandboxLibrary:
    """Build the lab's sandbox library in ``out_dir``: the stubbed minillm package (the declared references
    and the grading helpers of :func:`grading_only`, ``master`` saying what the lab's sandbox code reaches),
    rewritten copies of other packages' files, the operator bans, and the runner folder (sandbox_runner.py,
    wire.py, the ``_minillm_reference`` module and the stubbed ``minillm``, found there first on the sandbox's
    path whatever installed the grader's, and bound over the original too)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    library = SandboxLibrary()
    package = _package()
    runner = out_dir / "runner"
    runner.mkdir(exist_ok=True)
    copy = runner / "minillm"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.c", "*.h", "*.so"))
    library.package_binds.append((str(copy), str(package)))
    by_module: dict[str, list[tuple[str, object]]] = {}
    for exercise, refs in references.items():
        for ref in refs:
            if ref.startswith("aten::"):
                for op in OPERATOR_FAMILIES.get(ref.partition("@")[0], [ref]):
                    library.bans[op] = _message(lab, exercise, ref.partition("@")[0])
                continue
            module, _, qualname = ref.partition(":")
            by_module.setdefault(module, []).append((qualname or "*", (exercise, lab)))
    for module, qualname, message in grading_only(lab, master, package):
        named = {q for q, _ in by_module.get(module, [])}
        if qualname not in named and "*" not in named:  # a declared one keeps its exercise's message
            by_module.setdefault(module, []).append((qualname, message))
    for module, targets in sorted(by_module.items()):
        original = _module_file(module)
        if original is None:
            raise ValueError(f"reference module {module} has no Python source to stub")
        source, done = _rewrite(original.read_text(encoding="utf-8"), targets, module)
        library.stubbed += done
        original = original.resolve()
        if package in original.parents:
            (copy / original.relative_to(package)).write_text(source, encoding="utf-8")
        else:
            digest = hashlib.sha256(str(original).encode()).hexdigest()[:12]
            rewritten = out_dir / "overrides" / f"{digest}_{original.name}"
            rewritten.parent.mkdir(parents=True, exist_ok=True)
            rewritten.write_text(source, encoding="utf-8")
            library.package_binds.append((str(rewritten), str(original)))
    here = Path(__file__).resolve().parent
    for name in ("sandbox_runner.py", "wire.py"):
        shutil.copyfile(here / name, runner / name)
    (runner / "_minillm_reference.py").write_text(REFERENCE_MODULE, encoding="utf-8")
    library.runner_dir = runner
    (out_dir / "library.json").write_text(json.dumps({"stubbed": library.stubbed, "bans": library.bans,
                                                      "binds": library.package_binds}, indent=1), encoding="utf-8")
    return library


def reference_sources(references: dict[str, list[str]]) -> dict[str, list[tuple[str, str]]]:
    """``{exercise: [(reference name, its source)]}`` of the declared Python references (for the
    similarity report: a solution cell close to a reference's source is flagged)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for exercise, _, module, qualname, path in _python_references(references):
        if path is None:
            continue
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        node = tree if qualname in ("", "*") else _find(tree, qualname.split("."))
        if node is None:
            continue
        functions = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else [
            n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            segment = ast.get_source_segment(source, function)
            if segment:
                found.setdefault(exercise, []).append((f"{module}.{function.name}", segment))
    return found
