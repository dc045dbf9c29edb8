"""The borders STYLE.md draws between the project's files (issue #44 item 4): the task types
(tasks.py) and the other papers' variants (recipes.py) are libraries spell.py looks up; they import
no project module and read no config, so a fork of one task or one variant is a fork of one file.
Read from each file's syntax tree, not by importing it."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every module of the project a library could reach for
PROJECT = {p.stem for p in ROOT.glob("*.py")} | {"kernels", "bench", "tests", "conftest"}
# names under which a config travels in spell.py and infra.py
CONFIG_NAMES = {"cfg", "config", "Config", "load_config"}


def imported_modules(tree: ast.Module) -> set[str]:
    """The top-level module of every import, wherever it sits (a function's body included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom):  # a relative import is the project's by definition
            found.add("." * node.level + (node.module or ""))
    return found


def config_reads(tree: ast.Module) -> list[str]:
    """Where the module names a config: a parameter, a variable or an attribute base so called."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg in CONFIG_NAMES:
            hits.append(f"parameter {node.arg} (line {node.lineno})")
        elif isinstance(node, ast.Name) and node.id in CONFIG_NAMES:
            hits.append(f"name {node.id} (line {node.lineno})")
    return hits


@pytest.mark.parametrize("library", ["tasks.py", "recipes.py"])
def test_the_libraries_import_no_project_module_and_read_no_config(library):
    tree = ast.parse((ROOT / library).read_text(), filename=library)
    reached = {m for m in imported_modules(tree) if m in PROJECT or m.startswith(".")}
    assert not reached, f"{library} imports {sorted(reached)}: spell.py passes values in instead"
    assert not config_reads(tree), f"{library} reads a config: {config_reads(tree)}"


def test_the_border_check_sees_an_import_and_a_config():
    """The two readers on a planted module: a late project import inside a function and a config
    parameter are both found."""
    planted = ast.parse("import math\ndef f(cfg):\n    import infra\n    return cfg.train.lr\n")
    assert imported_modules(planted) == {"math", "infra"}
    assert config_reads(planted) == ["parameter cfg (line 2)", "name cfg (line 4)"]
