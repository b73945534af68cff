"""DESIGN.md's one-way data flow: LLM -> Engine -> Scheduler/BlockManager -> ModelRunner ->
model -> layers -> kernels. Lower floors never import higher ones."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"

# Floor of each part; a module may import only parts on its own floor or below.
FLOORS = {
    "config": 0, "seams": 0, "sampling": 0, "structured": 0, "hardware": 0, "kernels": 0, "quant": 0, "spec": 0,
    "threads": 0,
    "lora": 0,
    "layers": 1,
    "models": 2,
    "engine": 3,
    "outputs": 4, "llm": 4,
    "bench": 5, "lab": 5, "cli": 5, "adapters": 5, "serve": 5, "fleet": 5, "__init__": 5, "__main__": 5,
}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def imported_parts(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE)
    parts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and node.module.split(".")[0] == "minillm":
                    names = node.module.split(".")[1:]
                    parts.add(names[0] if names else "__init__")
                continue
            # Resolve a relative import against the module's package.
            base = list(rel.parent.parts)[: len(rel.parent.parts) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            if target:
                parts.add(target[0])
            else:  # `from .. import x` at the top: x names the part
                parts.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "minillm":
                    names = alias.name.split(".")[1:]
                    parts.add(names[0] if names else "__init__")
    return parts


def test_every_part_has_a_floor():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(FLOORS), f"give these a floor in FLOORS: {sorted(parts - set(FLOORS))}"


def test_lower_floors_never_import_higher_ones():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = part_of(path)
        for other in imported_parts(path):
            if other in FLOORS and FLOORS[other] > FLOORS[mine]:
                violations.append(f"{path.relative_to(PACKAGE)} ({mine}, floor {FLOORS[mine]}) imports {other} (floor {FLOORS[other]})")
    assert not violations, "\n".join(violations)


def test_block_manager_is_plain_python():
    source = (PACKAGE / "engine" / "block_manager.py").read_text()
    assert "import torch" not in source, "the block manager stays free of torch (STYLE.md)"


def test_the_package_holds_no_instructor_pipeline():
    """The course build and the autograder (masters, hidden-test handling, the grader's defences) live
    in grading/ at the repository root: minillm, which learners install and read, never imports them."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(PACKAGE)} imports {name}" for name in names
                          if name.split(".")[0] in {"grading", "nbgrader"}]
    assert not offenders, "\n".join(offenders)
    assert not [p for p in (PACKAGE / "lab").glob("*.py") if p.stem in {"build", "grading", "grading_execute", "screen", "guard", "feedback"}]
