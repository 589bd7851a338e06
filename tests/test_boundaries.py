"""DESIGN.md's package boundaries, enforced by walking every module's imports.

Two rules: a package never imports across its boundary (FORBIDDEN), and nobody imports another
package's private modules (`pkg._x`, `pkg.sub._x`, `from pkg import _x`): only the public names
a package exports. Tests may reach into the package they test, from its mirror folder only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# package -> top-level modules it must never import
FORBIDDEN = {
    "coldsnap_runtime": {"coldsnap_provider", "coldsnap_probe"},
    "coldsnap_probe": {"coldsnap_provider", "coldsnap_runtime", "anyio", "aiodocker", "aiohttp", "msgspec",
                       "structlog", "nccl_shim"},
    "nccl_shim": {"coldsnap_provider", "coldsnap_runtime", "anyio", "aiodocker"},
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


PACKAGES = ("coldsnap_provider", "coldsnap_runtime", "coldsnap_probe", "nccl_shim")
# tests/<folder> may import the private modules of the package it mirrors; nothing else may.
MIRRORS = {"provider": "coldsnap_provider", "runtime": "coldsnap_runtime", "probe": "coldsnap_probe",
           "shim": "nccl_shim"}
WALKED = (*PACKAGES, "bench", "engines", "tests")


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in dotted.split(".")[1:])


def private_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import of a project package's private module."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            dotted = [node.module] if _private(node.module) else [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in dotted if name.split(".")[0] in PACKAGES and _private(name)]
    return found


def owner(path: Path) -> str | None:
    """The package whose private modules `path` may import: its own, or the one its test folder mirrors."""
    parts = path.relative_to(ROOT).parts
    if parts[0] in PACKAGES:
        return parts[0]
    if parts[0] == "tests" and len(parts) > 2:
        return MIRRORS.get(parts[1])
    return None


@pytest.mark.parametrize("root", WALKED)
def test_nobody_imports_another_packages_private_modules(root: str) -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {name}"
                 for path in sorted((ROOT / root).rglob("*.py"))
                 for line, name in private_imports(path) if name.split(".")[0] != owner(path)]
    assert not offenders, "private imports across packages:\n" + "\n".join(offenders)


def test_the_private_import_rule_can_fail(tmp_path: Path) -> None:
    """The walker sees each form of a private import (and passes relative and public ones)."""
    sample = tmp_path / "sample.py"
    sample.write_text("import coldsnap_probe._cuda\nfrom coldsnap_runtime.backend._docker import DockerBackend\n"
                      "from coldsnap_runtime.backend import _docker\nfrom nccl_shim import Shim\n"
                      "from . import _sibling\nimport coldsnap_probe.__main__\n")
    assert [name for _, name in private_imports(sample)] == [
        "coldsnap_probe._cuda", "coldsnap_runtime.backend._docker", "coldsnap_runtime.backend._docker"]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_across_its_boundary(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = imported_modules(path) & FORBIDDEN[package]
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def test_only_the_docker_backend_imports_aiodocker() -> None:
    users = [p.relative_to(ROOT).as_posix() for pkg in ("coldsnap_provider", "coldsnap_runtime")
             for p in sorted((ROOT / pkg).rglob("*.py")) if "aiodocker" in imported_modules(p)]
    # The Docker backend's modules: the connection, the container bookkeeping and the backend itself.
    assert users == ["coldsnap_runtime/backend/_containers.py", "coldsnap_runtime/backend/_docker.py",
                     "coldsnap_runtime/backend/_engine.py"]


def test_probe_imports_with_the_standard_library_alone() -> None:
    """A capsule has only its own python3: importing the probe must not pull in the daemon's stack."""
    code = ("import sys, coldsnap_probe, coldsnap_probe.hydration, coldsnap_probe.__main__, coldsnap_probe._restore, "
            "coldsnap_probe._capture, coldsnap_probe._profile; "
            "[getattr(p, n) for p in (coldsnap_probe, coldsnap_probe.hydration) for n in p.__all__]; "  # lazy names
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('anyio', 'aiodocker', 'aiohttp', 'msgspec', 'structlog', 'coldsnap_provider')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-I", "-c", code], cwd=ROOT, check=True)


def sibling_imports(path: Path) -> set[str]:
    """The package's own modules `path` imports (relative imports, type-only ones included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
    return names


def import_circles(package: Path) -> list[list[str]]:
    graph = {p.stem: sibling_imports(p) & {q.stem for q in package.glob("*.py")} for p in package.glob("*.py")}
    circles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                circles.append([*path[path.index(imported):], imported])
            elif imported not in done:
                visit(imported, [*path, imported])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    return circles


@pytest.mark.parametrize("package", ["coldsnap_provider", "coldsnap_runtime", "coldsnap_runtime/backend",
                                     "coldsnap_probe", "nccl_shim"])
def test_package_modules_import_each_other_without_a_circle(package: str) -> None:
    """Regression: #29 (`_operations` and `_remote` imported each other); dependencies run one way."""
    assert import_circles(ROOT / package) == []


def test_the_circle_rule_can_fail(tmp_path: Path) -> None:
    (tmp_path / "_a.py").write_text("from ._b import x\n")
    (tmp_path / "_b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import y\n")
    assert import_circles(tmp_path) == [["_a", "_b", "_a"]]
