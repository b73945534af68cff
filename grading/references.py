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

The grader itself keeps the real implementations: its checks compare against them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
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


def _rewrite(source: str, targets: list[tuple[str, str, str]], module: str) -> tuple[str, list[str]]:
    tree = ast.parse(source)
    done = []
    for qualname, exercise, lab in targets:
        node = tree if qualname == "*" else _find(tree, qualname.split("."))
        if node is None:
            raise ValueError(f"reference {module}:{qualname} (exercise {exercise}) does not exist")
        prefix = module if qualname == "*" else f"{module}.{qualname}"
        done += _stub(node, prefix, _message(lab, exercise, prefix))
    return ast.unparse(tree) + "\n", done


def prepare(lab: str, references: dict[str, list[str]], out_dir: Path) -> SandboxLibrary:
    """Build the lab's sandbox library in ``out_dir``: the stubbed minillm package, rewritten copies of
    other packages' files, the operator bans, and the runner folder (sandbox_runner.py, wire.py and
    the ``_minillm_reference`` module)."""
    import minillm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    library = SandboxLibrary()
    package = Path(minillm.__file__).resolve().parent
    copy = out_dir / "minillm"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.c", "*.h", "*.so"))
    library.package_binds.append((str(copy), str(package)))
    by_module: dict[str, list[tuple[str, str, str]]] = {}
    for exercise, refs in references.items():
        for ref in refs:
            if ref.startswith("aten::"):
                for op in OPERATOR_FAMILIES.get(ref.partition("@")[0], [ref]):
                    library.bans[op] = _message(lab, exercise, ref.partition("@")[0])
                continue
            module, _, qualname = ref.partition(":")
            by_module.setdefault(module, []).append((qualname or "*", exercise, lab))
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
    runner = out_dir / "runner"
    runner.mkdir(exist_ok=True)
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
