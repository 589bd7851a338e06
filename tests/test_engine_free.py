"""tests/engine-free.txt: the modules a whole-suite `scripts/test` runs in a second pytest process beside the main
run. Each named file exists once; none of them asks for an engine (a fixture, the Docker CLI helper, a daemon or
CRIU), read from its syntax tree; and in that process the helpers themselves refuse one (the net under this check)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT, refuse_engine

LIST = ROOT / "tests" / "engine-free.txt"
# Fixtures that reach dockerd, the registry, node-b, the cluster or a daemon (tests/conftest.py, tests/runtime/
# conftest.py, tests/provider/test_remote.py), and the helpers that start or drive one.
ENGINE_FIXTURES = {"busybox_image", "registry", "cluster", "no_leftovers", "node_b", "node_b_registry", "daemon",
                   "session"}
ENGINE_CALLS = {"running_daemon", "module_daemon", "Daemon", "docker", "criu_wrapper", "bring_up"}


def listed() -> list[str]:
    return [line for line in LIST.read_text().splitlines() if line and not line.startswith("#")]


def parametrized(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The argument names a function's `parametrize` marks give (a parameter, not a fixture, of that name)."""
    names: set[str] = set()
    for decorator in function.decorator_list:
        if (isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"
                and decorator.args):
            first = decorator.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names |= {name.strip() for name in first.value.split(",")}
            elif isinstance(first, ast.Tuple | ast.List):
                names |= {e.value for e in first.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return names


def engine_uses(source: str) -> set[str]:
    """The engine fixtures a module's functions take and the engine helpers it calls."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            taken = {arg.arg for arg in node.args.args + node.args.kwonlyargs} - parametrized(node)
            found |= taken & ENGINE_FIXTURES
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            found |= {name} & ENGINE_CALLS
    return found


def test_every_listed_module_exists_once() -> None:
    names = listed()
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert [n for n in names if not (ROOT / n).is_file() or not Path(n).name.startswith("test_")] == []


def test_no_listed_module_asks_for_an_engine() -> None:
    uses = {name: engine_uses((ROOT / name).read_text()) for name in listed()}
    assert {name: found for name, found in uses.items() if found} == {}


def test_the_check_sees_a_fixture_and_a_daemon() -> None:
    source = ("async def test_x(busybox_image):\n    async with running_daemon() as d:\n        docker('ps')\n"
              "@pytest.mark.parametrize(('registry', 'tag'), [('r', 't')])\ndef test_y(registry, tag): pass\n")
    assert engine_uses(source) == {"busybox_image", "running_daemon", "docker"}


def test_the_engine_free_process_refuses_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLDSNAP_TEST_ENGINE_FREE", "1")
    with pytest.raises(pytest.fail.Exception, match="a daemon is used in the engine-free test process"):
        refuse_engine("a daemon")
    monkeypatch.setenv("COLDSNAP_TEST_ENGINE_FREE", "0")
    refuse_engine("a daemon")  # the main run: nothing refused
