"""Static screen of a student's solution cells before they are graded.

The grader runs only the solution cells of a submission (everything else comes from the
instructor master), and each of them is first read here, as source, outside the kernel. A cell
that could change how *later* cells run or what the checks do is not run: it is graded as if
the exercise were untouched (nbgrader's stub) and the row says why. Reading the source cannot be
fooled by anything the code does at run time; the runtime guard (grading/guard.py) watches
for what a screen of source could miss.

What a solution cell may not do (each rule names the cheat it closes):

- import modules that reach the interpreter, the kernel or the process (``sys``, ``os``,
  ``builtins``, ``importlib``, ``gc``, ``inspect``, ``ctypes``, ``IPython``, ``threading``,
  ``signal``, ``subprocess``, ``pickle`` ..., and this grader, ``grading``): input/AST transformers,
  tracers, excepthooks, patched modules, ``os._exit``, the guard;
- call or name ``exec``, ``eval``, ``compile``, ``__import__``, ``getattr``, ``setattr``,
  ``delattr``, ``globals``, ``vars``, ``locals``, ``get_ipython``, ``breakpoint``, ``open``,
  ``exit``, ``quit``: the indirect routes to the same;
- touch an attribute whose name starts with ``_`` (``__class__``, ``__globals__``,
  ``torch._C`` ...) or is one of the interpreter hooks (``settrace``, ``input_transformers_post``,
  ``modules``, ``environ``, ``overrides``, ``load_inline`` ...), or use a name starting with
  ``__`` or ``_minillm``;
- assign or delete an attribute of an imported module (``lab02.check_in_engine = ...``,
  ``torch.allclose = ...``) or of an object the lab's cells made (``llm.tokenizer = ...``,
  ``decode["ttft_s"] = ...``): patched helpers, checks and test inputs;
- rebind a builtin (``isinstance = ...``, ``def len``) or a name the master's locked cells bind
  (``llm``, ``torch``, ``lab02``, ``math`` ...), also through ``global``: the inputs and the tools
  of the tests;
- define comparison, truth or conversion methods (``__eq__``, ``__bool__``, ``__float__``,
  ``__torch_function__`` ...): objects that compare equal to anything.

It is a denylist over Python, so it is strict on purpose (a solution needs none of this); what
it does not cover is listed in grading/README.md.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass

FORBIDDEN_MODULES = frozenset(
    {
        "sys", "os", "posix", "nt", "builtins", "importlib", "imp", "gc", "inspect", "ctypes", "cffi",
        "grading",  # this grader: its guard runs in the graded kernel
        "IPython", "ipykernel", "jupyter_client", "nbclient", "nbgrader", "zmq", "traitlets",
        "traceback", "types", "unittest", "atexit", "signal", "threading", "_thread",
        "multiprocessing", "concurrent", "asyncio", "subprocess", "faulthandler", "code", "codeop",
        "pdb", "bdb", "trace", "tracemalloc", "runpy", "marshal", "pickle", "dill", "cloudpickle",
        "shelve", "copyreg", "weakref", "sysconfig", "site", "pkgutil", "zipimport", "socket",
        "shutil", "tempfile", "pathlib", "io", "fileinput", "mmap", "resource", "pty", "select",
        "warnings", "logging", "contextvars", "operator", "functools", "cython", "numba",
    }
)
FORBIDDEN_CALLS = frozenset(
    {
        "exec", "eval", "compile", "__import__", "getattr", "setattr", "delattr", "hasattr",
        "globals", "vars", "locals", "get_ipython", "breakpoint", "open", "exit", "quit",
        "input", "help", "memoryview",
    }
)
FORBIDDEN_ATTRIBUTES = frozenset(
    {
        "settrace", "setprofile", "gettrace", "excepthook", "displayhook", "audit", "addaudithook",
        "input_transformers_post", "input_transformers_cleanup", "ast_transformers", "events",
        "set_custom_exc", "register_magic_function", "run_line_magic", "run_cell_magic",
        "run_cell", "run_code", "user_ns", "user_global_ns", "kernel", "shell",
        "f_globals", "f_locals", "f_back", "f_trace", "f_code", "gi_frame", "cr_frame", "tb_frame",
        "modules", "meta_path", "path_hooks", "path_importer_cache", "environ", "putenv",
        "system", "popen", "spawn", "fork", "kill", "abort",
        "overrides", "library", "cpp_extension", "load_inline", "load_library", "ctypeslib",
        "set_default_device", "manual_seed", "seed", "set_rng_state", "use_deterministic_algorithms",
        "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
        "register_module_forward_hook", "register_module_forward_pre_hook",
    }
)
# Methods a class may define; the others (comparisons, truth, conversions, attribute hooks,
# __torch_function__ ...) let an object pass an assertion it should fail.
ALLOWED_DUNDER_METHODS = frozenset(
    {"__init__", "__repr__", "__str__", "__call__", "__post_init__", "__iter__", "__next__",
     "__enter__", "__exit__"}
)
BUILTIN_NAMES = frozenset(name for name in dir(builtins) if not name.startswith("_"))


@dataclass(frozen=True)
class Finding:
    """One reason a cell is not run: the line, and what it does."""

    line: int
    what: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}"


def _bound_names(target: ast.AST) -> list[str]:
    return [node.id for node in ast.walk(target) if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del))]


def names_bound_by(source: str) -> tuple[set[str], set[str]]:
    """(every name a cell binds at top level, the names it binds to modules by import)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set(), set()
    bound, modules = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name = (alias.asname or alias.name).split(".")[0]
                if alias.name == "*":
                    continue
                bound.add(name)
                if isinstance(node, ast.Import) or node.module in {"minillm.lab", "minillm"}:
                    modules.add(name)  # `from minillm.lab import lab02` binds a module too
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.With)):
            targets = (
                node.targets if isinstance(node, ast.Assign)
                else [node.target] if not isinstance(node, ast.With)
                else [item.optional_vars for item in node.items if item.optional_vars is not None]
            )
            for target in targets:
                bound.update(_bound_names(target))
    return bound, modules


class _Screen(ast.NodeVisitor):
    def __init__(self, protected: frozenset[str], modules: frozenset[str]):
        self.protected = protected
        self.modules = set(modules)
        self.findings: list[Finding] = []
        self.depth = 0  # > 0 inside a function, lambda, comprehension or class body: local names
        self.local_names: list[set[str]] = []  # per enclosing function: its arguments and assigned names

    def flag(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(getattr(node, "lineno", 0), what))

    def check_binding(self, node: ast.AST, name: str) -> None:
        if name in BUILTIN_NAMES:
            self.flag(node, f"rebinds the builtin {name!r}")
        elif name in self.protected and (self.depth == 0 or isinstance(node, ast.Global)):
            self.flag(node, f"rebinds {name!r}, which the lab's own cells define (the tests use it)")
        elif name.startswith("__") or name.startswith("_minillm"):
            self.flag(node, f"binds the reserved name {name!r}")

    # imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            root = alias.name.split(".")[0]
            if root in FORBIDDEN_MODULES:
                self.flag(node, f"imports {alias.name} (it reaches the interpreter, the kernel or the process)")
            bound = (alias.asname or root)
            if not (alias.asname is None and bound in self.modules):  # `import torch` again is the same module
                self.check_binding(node, bound)
            self.modules.add(bound)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        root = module.split(".")[0]
        if node.level or root in FORBIDDEN_MODULES:
            self.flag(node, f"imports from {module or '.'} (it reaches the interpreter, the kernel or the process)")
        for alias in node.names:
            if alias.name == "*":
                self.flag(node, f"imports * from {module} (it may rebind the lab's names)")
                continue
            if alias.name.startswith("_") or alias.name in FORBIDDEN_CALLS | FORBIDDEN_ATTRIBUTES:
                self.flag(node, f"imports {alias.name} from {module}")
            bound = alias.asname or alias.name
            if not (alias.asname is None and bound in self.modules and module.startswith("minillm")):
                self.check_binding(node, bound)  # `from minillm.lab import lab02` again is the same module
            if module.startswith("minillm") or root in {"torch", "triton", "numpy"}:
                self.modules.add(bound)  # a submodule or a module-level object: no attribute writes
        self.generic_visit(node)

    # names and attributes
    def visit_Name(self, node: ast.Name) -> None:
        if node.id in FORBIDDEN_CALLS:
            self.flag(node, f"uses {node.id} (an indirect route to the interpreter)")
        elif isinstance(node.ctx, (ast.Store, ast.Del)):
            self.check_binding(node, node.id)
        elif node.id.startswith("__") or node.id.startswith("_minillm"):
            self.flag(node, f"uses the reserved name {node.id!r}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr.startswith("_") and node.attr not in ALLOWED_DUNDER_METHODS:
            self.flag(node, f"touches the private attribute .{node.attr}")
        elif node.attr in FORBIDDEN_ATTRIBUTES:
            self.flag(node, f"touches .{node.attr} (an interpreter, kernel or library hook)")
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            base = node.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if isinstance(base, ast.Name) and base.id in self.modules:
                self.flag(node, f"{'assigns' if isinstance(node.ctx, ast.Store) else 'deletes'} "
                                f"{ast.unparse(node)} (patches a module the tests use)")
            elif isinstance(base, ast.Name) and base.id in self.protected and not self._is_local(base.id):
                self.flag(node, f"changes {ast.unparse(node)}: {base.id} is the lab's own (the tests read it)")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            base = node.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if isinstance(base, ast.Name) and base.id in self.modules:
                self.flag(node, f"writes into {ast.unparse(node)} (patches a module the tests use)")
            elif isinstance(base, ast.Name) and base.id in self.protected and not self._is_local(base.id):
                self.flag(node, f"changes {ast.unparse(node)}: {base.id} is the lab's own (the tests read it)")
        self.generic_visit(node)

    def _is_local(self, name: str) -> bool:
        return any(name in scope for scope in self.local_names)

    # definitions
    def _visit_function(self, node) -> None:
        self.check_binding(node, node.name) if not node.name.startswith("__") else None
        for decorator in node.decorator_list:
            self.visit(decorator)
        self.visit(node.args)
        if node.returns is not None:
            self.visit(node.returns)
        arguments = node.args
        names = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
        names |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
        declared_global = {n for stmt in ast.walk(node) if isinstance(stmt, (ast.Global, ast.Nonlocal)) for n in stmt.names}
        for statement in node.body:
            for target in ast.walk(statement):
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    names.add(target.id)
        self.local_names.append(names - declared_global)
        self.depth += 1
        for statement in node.body:
            self.visit(statement)
        self.depth -= 1
        self.local_names.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_arg(self, node: ast.arg) -> None:
        if node.arg.startswith("__") or node.arg.startswith("_minillm"):
            self.flag(node, f"binds the reserved name {node.arg!r}")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.check_binding(node, node.name)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("__"):
                if item.name not in ALLOWED_DUNDER_METHODS:
                    self.flag(item, f"defines {node.name}.{item.name} (an object that can pass a check it should fail)")
        for keyword in node.keywords:
            self.flag(node, f"class {node.name} takes {keyword.arg}= (a metaclass changes how checks see it)")
        for base in node.bases:
            self.visit(base)
        for decorator in node.decorator_list:
            self.visit(decorator)
        self.depth += 1
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("__"):
                self.visit(item.args)
                for statement in item.body:
                    self.visit(statement)
            else:
                self.visit(item)
        self.depth -= 1

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            self.check_binding(node, name)

    visit_Nonlocal = visit_Global

    def _visit_local_scope(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_Lambda = _visit_local_scope
    visit_ListComp = _visit_local_scope
    visit_SetComp = _visit_local_scope
    visit_DictComp = _visit_local_scope
    visit_GeneratorExp = _visit_local_scope


def screen_source(source: str, protected: set[str] | frozenset[str] = frozenset(),
                  modules: set[str] | frozenset[str] = frozenset()) -> list[Finding]:
    """The reasons not to run one solution cell (empty: run it).

    ``protected``: names the master's locked cells bind (the tests' inputs and tools);
    ``modules``: the names among them bound to modules (their attributes may not be written).
    IPython magics and shell escapes (``%time``, ``!ls``) are refused too: they are not Python.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        from IPython.core.inputtransformer2 import TransformerManager

        try:
            ast.parse(TransformerManager().transform_cell(source))
        except SyntaxError:
            return []  # not Python even for IPython: it runs as written and fails with Python's message
        return [Finding(0, "uses IPython syntax (a magic, a shell escape or ?-help), which graded cells may not")]
    visitor = _Screen(frozenset(protected), frozenset(modules))
    visitor.visit(tree)
    unique = {(f.line, f.what): f for f in visitor.findings}
    return sorted(unique.values(), key=lambda f: f.line)
