"""Issue 29's house rules for the four packages, enforced: small modules, short functions, no orphan code.

* A module has at most 600 lines, and a function (nested ones too) fewer than 60: a reader sees it whole.
* Every public function, class and method has a production caller. A public name (no leading
  underscore) defined at the top of a package module, or as a method of a top-level class there, must
  be referenced by name from production code: any module of the four packages, `bench/` or `engines/`, other
  than the definition itself, the package's `__init__` re-export and `__all__`. Tests do not count;
  `main` (the entry points) does not need a caller. The check is by name, so it is generous (a method
  named like another's counts as used, but a variable or an attribute assigned that name does not);
  it catches code that nothing but a test reaches, which is what #29 asked to wire in or delete.

Each failure lists every offender with its path and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.helpers import ROOT

CHECKED = ("coldsnap_provider", "coldsnap_runtime", "coldsnap_probe", "nccl_shim")
PRODUCTION = (*CHECKED, "bench", "engines")
ENTRY_POINTS = frozenset({"main"})  # `python -m <package>` and `python -m coldsnap_probe.hydration`
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 59


def definitions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(name, node) of the public functions and classes at the module's top, and their public methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                yield from ((sub.name, sub) for sub in node.body
                            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and not sub.name.startswith("_"))


def references(path: Path) -> set[str]:
    """Every name `path` uses (loads, attributes, imports), not counting re-exports from a package __init__."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):  # a variable of that name is no caller
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and path.name != "__init__.py":
            names.update(alias.name for alias in node.names)
    return names


def used_in_own_module(name: str, node: ast.AST, tree: ast.Module) -> bool:
    """Referenced in its module anywhere but inside its own definition (`node` is a node of `tree`)."""
    inside = {id(n) for n in ast.walk(node)}
    return any(((isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name))
               and isinstance(n.ctx, ast.Load) for n in ast.walk(tree) if id(n) not in inside)


def orphans(checked: Sequence[Path], production: Sequence[Path], root: Path) -> list[str]:
    """`path:line name` of every public definition in `checked` that no module of `production` reaches."""
    used = {p: references(p) for p in production}
    found = []
    for path in checked:
        tree = ast.parse(path.read_text())
        elsewhere = set().union(*(names for other, names in used.items() if other != path))
        found += [f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)} {name}"
                  for name, node in definitions(tree)
                  if name not in ENTRY_POINTS and name not in elsewhere and not used_in_own_module(name, node, tree)]
    return found


def oversized(paths: Sequence[Path], root: Path) -> list[str]:
    """Every module over MAX_MODULE_LINES, and every function over MAX_FUNCTION_LINES, with its length."""
    found = []
    for path in paths:
        text = path.read_text()
        if (lines := text.count("\n")) > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {lines} lines (at most {MAX_MODULE_LINES})")
        found += [f"{path.relative_to(root)}:{node.lineno} {node.name}: {length} lines (under 60)"
                  for node in ast.walk(ast.parse(text))
                  if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                  and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES]
    return found


def modules(*roots: str) -> list[Path]:
    return [p for root in roots for p in sorted((ROOT / root).rglob("*.py"))]


@pytest.mark.parametrize("package", CHECKED)
def test_every_public_definition_has_a_production_caller(package: str) -> None:
    found = orphans(modules(package), modules(*PRODUCTION), ROOT)
    assert not found, "reached only from tests (wire it in or delete it, #29):\n" + "\n".join(found)


@pytest.mark.parametrize("package", CHECKED)
def test_modules_stay_within_600_lines_and_functions_under_60(package: str) -> None:
    """Small modules with one job, functions a reader sees whole."""
    found = oversized(modules(package), ROOT)
    assert not found, "over the size limits (#29):\n" + "\n".join(found)


def test_the_caller_rule_can_fail(tmp_path: Path) -> None:
    """Functions, classes and methods nothing reaches are found (a same-named variable is no caller);
    used ones, private ones and entry points pass."""
    (tmp_path / "_lib.py").write_text(
        "def used(): pass\ndef orphan(): pass\ndef _private(): pass\ndef main(): pass\n"
        "class Thing:\n    def called(self): pass\n    def never(self): pass\n"
        "def recursive(): return recursive()\ndef shadowed(): pass\n")
    (tmp_path / "app.py").write_text("from ._lib import used, Thing\nused()\nThing().called()\nshadowed = 1\n"
                                     "Thing().never = 2\n")
    (tmp_path / "__init__.py").write_text("from ._lib import orphan as orphan\n__all__ = ('orphan',)\n")
    found = orphans([tmp_path / "_lib.py"], sorted(tmp_path.glob("*.py")), tmp_path)
    assert found == ["_lib.py:2 orphan", "_lib.py:7 never", "_lib.py:8 recursive", "_lib.py:9 shadowed"]


def test_the_size_rule_can_fail(tmp_path: Path) -> None:
    """A module over 600 lines and a function of 60 lines are found; a function of 59 lines passes."""
    body = "".join(f"    x{i} = {i}\n" for i in range(58))
    (tmp_path / "short.py").write_text("def f():\n" + body + "\n")  # 59 lines of function
    (tmp_path / "long.py").write_text("async def g():\n" + body + "    x = 1\n")  # 60 lines
    (tmp_path / "big.py").write_text("x = 1\n" * 601)
    found = oversized(sorted(tmp_path.glob("*.py")), tmp_path)
    assert found == ["big.py: 601 lines (at most 600)", "long.py:1 g: 60 lines (under 60)"]
