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


# The whole repository's Python import graph (issue 39): every module of the packages, engines, bench, scripts/*.py
# and tests is a node; an import (at any depth of the file: function-level and type-only ones included) is an
# arrow. Rooms, from the top: an arrow may point down or sideways within its room, never up. The packages are the
# floor, engines (the capsule-side model servers) stand on the probe, bench drives the daemon and the engines,
# scripts drive bench, and tests may import anything. (The C side's call graph between files: helper cmem's
# check, beside this one.)
ROOMS = {"coldsnap_probe": 0, "coldsnap_runtime": 0, "nccl_shim": 0, "coldsnap_provider": 1, "engines": 2,
         "bench": 3, "scripts": 4, "tests": 5}
# bench/'s own floors: the shared helpers, the e2e sequence's steps and the small parts a run builds on, the
# units composed of them, and the runners (every module not named here) on top.
BENCH_FLOORS = {"bench._common": 0, "bench._daemon": 0, "bench.engine_rows": 0,
                "bench.e2e_restore": 1, "bench.page_fill": 1, "bench.serve_client": 1, "bench.tp_plan": 1,
                "bench.tp2_restore": 1,
                "bench.interposer_units": 2, "bench.serve_units": 2, "bench.serve_faults": 2, "bench.tp_units": 2}
BENCH_RUNNERS = 3


def repository_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the rooms (scripts: its top-level *.py)."""
    files = [p for room in ROOMS if room != "scripts" for p in sorted((root / room).rglob("*.py"))]
    files += sorted((root / "scripts").glob("*.py"))
    modules = {}
    for path in files:
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The repository's modules `name` imports: `from a import b` names a.b when that is a module, else a; a
    relative import is resolved against the package, and a script's `from _common import x` against its folder."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *([base] if base else [])])
            elif base.split(".")[0] not in ROOMS and f"{package}.{base}" in modules:
                base = f"{package}.{base}"
            dotted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in dotted:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = repository_modules(root)
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def graph_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: each strongly connected set of two or more modules, sorted (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(members) > 1:
                        circles.append(sorted(members))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(graph.get(target, ())))))
            elif target in stack:
                low[node] = min(low[node], index[target])
    return sorted(circles)


def floor(module: str) -> tuple[int, int]:
    """(room, floor within bench/) of a module: the order an arrow must not climb."""
    room = ROOMS[module.split(".")[0]]
    return room, BENCH_FLOORS.get(module, BENCH_RUNNERS) if module.startswith("bench.") else 0


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Each arrow to a higher room or bench floor, or sideways between two rooms of the same height."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            (room, level), (to_room, to_level) = floor(module), floor(target)
            across = module.split(".")[0] != target.split(".")[0]
            if to_room > room or (to_room == room and across) or (to_room == room and to_level > level):
                wrong.append(f"{module} -> {target}")
    return wrong


def test_the_repositorys_import_graph_has_no_circle() -> None:
    """Regression (issue 39): bench.e2e_restore's `__main__` imported bench.e2e_modes, which (through the units)
    imports bench.e2e_restore."""
    assert graph_circles(import_graph(ROOT)) == []


def test_no_import_climbs_a_room_or_a_bench_floor() -> None:
    """Regression (issue 39): bench._common and bench.e2e_restore imported tests.helpers; scripts/_device_gpus.py
    too. Packages import neither bench nor tests, bench imports no test code, scripts import no test code."""
    assert upward_arrows(import_graph(ROOT)) == []


def test_every_bench_floor_names_a_module() -> None:
    modules = repository_modules(ROOT)
    assert sorted(set(BENCH_FLOORS) - set(modules)) == []


def test_the_graph_rules_can_fail(tmp_path: Path) -> None:
    """A circle through a function-level import and a script-style sibling import, and three upward arrows."""
    for folder in ("bench", "tests", "coldsnap_probe", "scripts"):
        (tmp_path / folder).mkdir()
    (tmp_path / "bench" / "_common.py").write_text("from tests.helpers import ROOT\n")
    (tmp_path / "bench" / "e2e_restore.py").write_text("def main():\n    from bench.e2e_modes import main\n")
    (tmp_path / "bench" / "e2e_modes.py").write_text("from _common import x\nfrom bench import e2e_restore\n")
    (tmp_path / "tests" / "helpers.py").write_text("import bench.e2e_modes\n")
    (tmp_path / "coldsnap_probe" / "__init__.py").write_text("from . import _cuda\n")
    (tmp_path / "coldsnap_probe" / "_cuda.py").write_text("import scripts.tool\n")
    (tmp_path / "scripts" / "tool.py").write_text("")
    graph = import_graph(tmp_path)
    assert graph["bench.e2e_modes"] == {"bench._common", "bench.e2e_restore"}
    assert graph_circles(graph) == [["bench._common", "bench.e2e_modes", "bench.e2e_restore", "tests.helpers"]]
    assert upward_arrows(graph) == ["bench._common -> tests.helpers", "bench.e2e_restore -> bench.e2e_modes",
                                    "coldsnap_probe._cuda -> scripts.tool"]


# --- The C side: the call graph between the C files (issue 39's goal "0 circles" for C calls between files),
# beside the Python graph's: tests/test_c_rules.py reads the C (a file that calls, or takes the address of, a
# non-static function another file defines is an arrow to it; an `#include "..."` is an arrow too), the same
# graph_circles() runs over it. ---
def test_the_c_files_call_and_include_each_other_without_a_circle() -> None:
    from tests.test_c_rules import c_files, call_graph, include_graph

    files = c_files(ROOT)
    calls = call_graph(files, ROOT)
    assert graph_circles(calls) == []
    assert graph_circles(include_graph(files, ROOT)) == []
    interposer = "coldsnap_probe/hydration/interposer/"
    assert f"{interposer}request.c" in calls[f"{interposer}connection.c"]  # the reader sees the arrows
    assert f"{interposer}control.c" not in calls[f"{interposer}regions.c"]  # the start hook, registered


def test_the_c_circle_rule_can_fail(tmp_path: Path) -> None:
    """Two files calling each other, and two headers including each other, are a circle each."""
    from tests.test_c_rules import call_graph, include_graph

    (tmp_path / "a.c").write_text("int b(void);\nint a(void) { return b(); }\n")
    (tmp_path / "b.c").write_text('/* a() */\nint a(void);\nstatic int own(void) { return 1; }\n'
                                  "int b(void) { return own() ? a() : 0; }\n")
    (tmp_path / "c.c").write_text('static int a(void) { return 0; }\nint c(void) { return a() + b(); }\n')
    graph = call_graph(sorted(tmp_path.glob("*.c")), tmp_path)
    assert graph["c.c"] == {"b.c"} and graph_circles(graph) == [["a.c", "b.c"]]  # c.c's static a() is its own
    (tmp_path / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "b.h").write_text('#include "a.h"\n')
    assert graph_circles(include_graph(sorted(tmp_path.glob("*.h")), tmp_path)) == [["a.h", "b.h"]]
