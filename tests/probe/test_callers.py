"""Every public function, class and method of coldsnap_probe and nccl_shim has a production caller (issue 29).

A public name (no leading underscore) defined at the top of a package module, or as a method of a top-level
class there, must be referenced by name from production code: any module of the four packages or of
`bench/`, other than the definition itself, the package's `__init__` re-export and `__all__`. Tests do not
count. The check is by name, so it is generous (a method named like another's counts as used); it catches
code that nothing but a test reaches, which is what #29 asked to wire in or delete.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

CHECKED = ("coldsnap_probe", "nccl_shim")
PRODUCTION = ("coldsnap_provider", "coldsnap_runtime", "coldsnap_probe", "nccl_shim", "bench")
ENTRY_POINTS = frozenset({"main"})  # `python -m <package>` and `python -m coldsnap_probe._hydrate`


def definitions(path: Path) -> Iterator[tuple[str, ast.AST]]:
    """(name, node) of the public functions and classes at the module's top, and their public methods."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                yield from ((sub.name, sub) for sub in node.body
                            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and not sub.name.startswith("_"))


def references(path: Path) -> set[str]:
    """Every name `path` uses (loads, attributes, imports), not counting re-exports from a package __init__."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and path.name != "__init__.py":
            names.update(alias.name for alias in node.names)
    return names


def callers_outside(name: str, node: ast.AST, path: Path, used: dict[Path, set[str]]) -> bool:
    if any(name in names for other, names in used.items() if other != path):
        return True
    # In its own module: referenced anywhere but inside its own definition.
    own = ast.parse(path.read_text())
    inside = {id(n) for n in ast.walk(node)}
    return any((isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)
               for n in ast.walk(own) if id(n) not in inside)


@pytest.mark.parametrize("package", CHECKED)
def test_every_public_definition_has_a_production_caller(package: str) -> None:
    used = {p: references(p) for root in PRODUCTION for p in sorted((ROOT / root).rglob("*.py"))}
    orphans = [f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)} {name}"
               for path in sorted((ROOT / package).rglob("*.py"))
               for name, node in definitions(path)
               if name not in ENTRY_POINTS and not callers_outside(name, node, path, used)]
    assert not orphans, "reached only from tests (wire it in or delete it, #29):\n" + "\n".join(orphans)


@pytest.mark.parametrize("package", CHECKED)
def test_modules_stay_under_600_lines_and_functions_under_60(package: str) -> None:
    """Issue 29's house rules for the capsule packages: small modules with one job, functions a reader sees whole."""
    too_long = []
    for path in sorted((ROOT / package).rglob("*.py")):
        text = path.read_text()
        if (lines := text.count("\n")) >= 600:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        too_long += [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
                     for node in ast.walk(ast.parse(text))
                     if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                     and (node.end_lineno or node.lineno) - node.lineno + 1 >= 60]
    assert not too_long, "\n".join(too_long)
