"""environment.yml's pip section mirrors pyproject.toml; torch stays pinned."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def pyproject_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return project["dependencies"] + extras["lab"] + extras["dev"]


def test_environment_yml_pip_section_mirrors_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    pip = [r for r in pip if not r.startswith("-e")]
    assert sorted(pip) == sorted(pyproject_requirements())


def test_torch_is_pinned_to_the_cpu_wheel_on_disk():
    # A range admitting newer releases pulls a multi-GB CUDA build on CPU machines.
    assert "torch==2.13.0" in pyproject_requirements()


def test_readme_opens_with_exactly_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make lab", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd "))] == ["make test"]


def test_the_llama_extra_pins_llama_cpp_python_alone():
    """`make bench-peers` installs .[llama]: one pinned package that builds llama.cpp from source (no torch of its own)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["llama"] == ["llama-cpp-python==0.3.36"]
    assert "pip install --progress-bar on -e '.[llama]'" in (ROOT / "Makefile").read_text()
