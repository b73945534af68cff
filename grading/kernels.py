"""A learner's Triton kernel, checked as source and run alone: nothing else of the submission runs with it.

A kernel exercise's values come from running the kernel (Triton's interpreter on a CPU), and the code
around it could be anything the student likes. So the grader takes the kernel cell's source as the
student handed it in, keeps only what a Triton kernel is made of, and runs that alone in a fresh sandbox
of its own (grading.remote.kernel_session): the imports of triton, constants, and the ``@triton.jit``
functions. Each function's body may use only Triton (``tl.*``, ``triton.*``), its own arguments and
locals, the cell's other kernels and constants, and a few builtins (``range``, ``min``, ``max``, ...); no
import, no name that starts with ``_``, no other module. :func:`extract` returns that source or the
problems, by line; the master lists its kernel exercises as ``"minillm": {"kernels": {grade_id: [names]}}``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

ALLOWED_BUILTINS = frozenset({"range", "min", "max", "abs", "int", "float", "bool", "len", "print", "isinstance",
                              "True", "False", "None"})
ALLOWED_IMPORTS = {("triton", None), ("triton.language", "tl"), ("triton", "triton")}
LAUNCHER = '''

def _minillm_launch(name, grid, args, kwargs):
    """Run one kernel of the cell's; every tensor argument goes back (the kernel writes through pointers)."""
    import torch
    globals()[name][grid](*args, **kwargs)
    return [a if isinstance(a, torch.Tensor) else None for a in args]
'''


@dataclass
class Kernels:
    source: str                                   # what the kernel sandbox runs: imports, constants, kernels
    names: list[str]                              # the kernels found
    stubs: list[str] = field(default_factory=list)    # kernels whose body is still the exercise's stub
    problems: list[str] = field(default_factory=list)


def _is_jit(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name)
            and target.value.id == "triton") or (isinstance(target, ast.Name) and target.id == "jit")


def _is_stub(function: ast.FunctionDef) -> bool:
    """The exercise's stub: the body still raises NotImplementedError (after the given first lines)."""
    for node in function.body:
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id == "NotImplementedError":
                return True
    return False


def _constant(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, bool, str)) or node.value is None
    if isinstance(node, ast.UnaryOp):
        return _constant(node.operand)
    if isinstance(node, ast.BinOp):
        return _constant(node.left) and _constant(node.right)
    return False


def _check_function(function: ast.FunctionDef, known: set[str]) -> list[str]:
    problems = []
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and not all(_constant(k.value) for k in decorator.keywords):
            problems.append(f"line {function.lineno}: @triton.jit(...) takes constant arguments only")
    args = function.args
    for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
        if not _constant(default):
            problems.append(f"line {function.lineno}: {function.name}'s defaults must be constants")
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    allowed = names | known | ALLOWED_BUILTINS | {"tl", "triton"}
    for node in ast.walk(function):
        line = getattr(node, "lineno", function.lineno)
        if node is not function and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            problems.append(f"line {line}: a kernel defines no function, class or lambda inside it")
        elif isinstance(node, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Await, ast.Yield,
                               ast.YieldFrom, ast.Try, ast.With, ast.AsyncWith, ast.Delete)):
            problems.append(f"line {line}: {type(node).__name__.lower()} is not part of a Triton kernel")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            problems.append(f"line {line}: .{node.attr}: a kernel uses no name that starts with _")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id not in allowed or node.id.startswith("_"):
                problems.append(f"line {line}: {node.id} is not Triton, an argument, a local, a constant or another "
                                "kernel of the cell (a kernel computes with tl.* only)")
    return problems


def extract(cell_source: str, wanted: list[str]) -> Kernels:
    """The kernel part of a solution cell: the triton imports, module constants and ``@triton.jit``
    functions it defines, checked; ``wanted`` are the kernels the exercise must define."""
    try:
        tree = ast.parse(cell_source)
    except SyntaxError as error:
        return Kernels("", [], problems=[f"line {error.lineno}: the cell does not parse: {error.msg}"])
    keep, constants, functions = [], set(), []
    for node in tree.body:
        if isinstance(node, ast.Import) and all((a.name, a.asname) in ALLOWED_IMPORTS for a in node.names):
            keep.append(node)
        elif isinstance(node, ast.ImportFrom) and node.module == "triton" and all(
                a.name == "language" and a.asname == "tl" for a in node.names):
            keep.append(node)
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and not node.targets[0].id.startswith("_") and _constant(node.value)):
            keep.append(node)
            constants.add(node.targets[0].id)
        elif isinstance(node, ast.FunctionDef) and node.decorator_list and all(_is_jit(d) for d in node.decorator_list):
            functions.append(node)
    known = constants | {f.name for f in functions}
    found = Kernels("", [f.name for f in functions])
    for function in functions:
        if _is_stub(function):
            found.stubs.append(function.name)
            continue
        found.problems += _check_function(function, known)
    missing = [name for name in wanted if name not in found.names]
    if missing:
        found.problems.append(f"the cell defines no @triton.jit {', '.join(missing)}")
    imports = [ast.parse("import triton\nimport triton.language as tl").body]
    module = ast.Module(body=[*imports[0], *keep, *functions], type_ignores=[])
    found.source = ast.unparse(module) + "\n" + LAUNCHER
    return found
