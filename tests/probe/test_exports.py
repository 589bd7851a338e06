"""The package's public names load on first use (`__init__.py`, `hydration/__init__.py`), so that each subcommand of
`python -m coldsnap_probe` imports only its own side (issue 22: what a restore worker pays before its first mark).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import coldsnap_probe
import coldsnap_probe.hydration
from tests.helpers import ROOT

# What a restore never needs: the capture side, the profile's canaries and model, the admission and its cache; nor,
# before any image asks it, the node hydrator's server and its copy engine (issue 35: the worker's start).
NOT_FOR_A_RESTORE = {"coldsnap_probe._capture", "coldsnap_probe._canaries", "coldsnap_probe._features",
                     "coldsnap_probe._model", "coldsnap_probe._cache", "coldsnap_probe._contracts",
                     "coldsnap_probe._quiesce", "coldsnap_probe.hydration._arena", "coldsnap_probe.hydration._hydrator",
                     "coldsnap_probe.hydration._copy"}


def modules_after(*args: str) -> tuple[set[str], int, str]:
    """The modules loaded by `python -m coldsnap_probe ARGS` (run as -m runs it), its exit status and stderr."""
    code = ("import json, runpy, sys\nsys.argv = ['coldsnap_probe', *json.loads(sys.argv[1])]\n"
            "try:\n    runpy.run_module('coldsnap_probe', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exc:\n    print(json.dumps([exc.code, sorted(sys.modules)]))\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, cwd=ROOT,
                          check=True, timeout=60)
    status, loaded = json.loads(done.stdout.splitlines()[-1])
    return set(loaded), status, done.stderr


@pytest.mark.parametrize("package", [coldsnap_probe, coldsnap_probe.hydration])
def test_every_public_name_resolves_to_its_definition(package: object) -> None:
    names = package.__all__  # type: ignore[attr-defined]
    assert set(names) == set(package._EXPORTS)  # type: ignore[attr-defined]
    for name in names:
        value = getattr(package, name)
        assert value is getattr(package, name) and name in dir(package)
    with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
        package.not_a_name  # type: ignore[attr-defined]  # noqa: B018


def test_renamed_exports_keep_their_public_names() -> None:
    from coldsnap_probe._graph import POLICIES
    from coldsnap_probe.jsonline import request

    assert coldsnap_probe.GRAPH_POLICIES is POLICIES and coldsnap_probe.hydration_request is request


def test_importing_the_package_imports_none_of_its_sides() -> None:
    code = "import coldsnap_probe, sys, json; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                                           check=True).stdout))
    assert {m for m in loaded if m.startswith("coldsnap_probe")} == {"coldsnap_probe"}


def test_the_restore_subcommand_imports_only_the_restore_side(tmp_path: Path) -> None:
    loaded, status, stderr = modules_after("restore", "--images", str(tmp_path))
    assert status == 1 and "capture.json" in stderr, stderr  # it ran the restore, which refused these images
    assert "coldsnap_probe._restore" in loaded and "coldsnap_probe._host" in loaded
    assert not loaded & NOT_FOR_A_RESTORE, sorted(loaded & NOT_FOR_A_RESTORE)


def test_the_capture_subcommand_imports_no_restore(tmp_path: Path) -> None:
    loaded, status, stderr = modules_after("capture", "--pid", "999999999", "--images", str(tmp_path / "images"))
    assert status == 1 and "error:" in stderr and "coldsnap_probe._capture" in loaded
    assert not loaded & {"coldsnap_probe._restore", "coldsnap_probe._canaries", "coldsnap_probe._features"}


def typed_exports(source: str) -> dict[str, str]:
    """What mypy sees: each `if TYPE_CHECKING:` import of an `__init__.py`, as public name -> "module" (the same
    name there) or "module:name", the form of its `_EXPORTS`."""
    import ast

    found: dict[str, str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in node.body:
                assert isinstance(sub, ast.ImportFrom) and sub.level == 1, ast.dump(sub)
                for alias in sub.names:
                    public = alias.asname or alias.name
                    assert public not in found, f"{public} imported twice"
                    found[public] = f".{sub.module}" + ("" if alias.name == public else f":{alias.name}")
    return found


@pytest.mark.parametrize("package", [coldsnap_probe, coldsnap_probe.hydration])
def test_the_types_mypy_sees_are_the_names_loaded_at_run_time(package: object) -> None:
    """Regression (review4): the TYPE_CHECKING imports (what mypy and readers see) and `_EXPORTS` (what
    `__getattr__` loads) are two lists of one thing; nothing checked they agree, so a name could be typed from
    one module and loaded from another, or typed and never loadable."""
    source = Path(package.__file__).read_text()  # type: ignore[attr-defined]
    assert typed_exports(source) == dict(package._EXPORTS)  # type: ignore[attr-defined]


def test_the_typed_exports_check_can_fail() -> None:
    source = Path(coldsnap_probe.__file__).read_text().replace("from ._host import boot_id as boot_id",
                                                               "from ._cache import boot_id as boot_id")
    assert typed_exports(source)["boot_id"] == "._cache" != coldsnap_probe._EXPORTS["boot_id"]


def test_a_star_import_binds_every_public_name() -> None:
    code = ("import json\nfrom coldsnap_probe import *\nfrom coldsnap_probe.hydration import *\n"
            "import coldsnap_probe, coldsnap_probe.hydration\n"
            "names = [*coldsnap_probe.__all__, *coldsnap_probe.hydration.__all__]\n"
            "print(json.dumps([n for n in names if n not in globals()]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(done.stdout) == []


def test_a_misspelt_public_name_is_a_type_error(tmp_path: Path) -> None:
    """Regression (review4): mypy typed every attribute of a module with a PEP 562 `__getattr__` as its return
    type (Any), so `from coldsnap_probe import misspelt` passed `mypy --strict` and failed only when run."""
    use = tmp_path / "use.py"
    use.write_text("from coldsnap_probe import cache_key, not_a_name\nfrom coldsnap_probe.hydration import also_not\n"
                   "x: int = cache_key\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
                           str(use)], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    errors = sorted(line.split(": error: ")[1] for line in done.stdout.splitlines() if ": error: " in line)
    assert errors == [
        'Incompatible types in assignment (expression has type "Callable[[str, str, str, str, str, str], str]", '
        'variable has type "int")  [assignment]',
        'Module "coldsnap_probe" has no attribute "not_a_name"  [attr-defined]',
        'Module "coldsnap_probe.hydration" has no attribute "also_not"  [attr-defined]'], done.stdout
