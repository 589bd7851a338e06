"""DESIGN.md's package boundaries, enforced by walking every module's imports."""

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


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_across_its_boundary(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = imported_modules(path) & FORBIDDEN[package]
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def test_only_the_docker_backend_imports_aiodocker() -> None:
    users = [p.relative_to(ROOT).as_posix() for pkg in ("coldsnap_provider", "coldsnap_runtime")
             for p in (ROOT / pkg).rglob("*.py") if "aiodocker" in imported_modules(p)]
    assert users == ["coldsnap_runtime/backend/_docker.py"]


def test_probe_imports_with_the_standard_library_alone() -> None:
    """A capsule has only its own python3: importing the probe must not pull in the daemon's stack."""
    code = ("import sys, coldsnap_probe; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('anyio', 'aiodocker', 'aiohttp', 'msgspec', 'structlog', 'coldsnap_provider')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-I", "-c", code], cwd=ROOT, check=True)
