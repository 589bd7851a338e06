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

# What a restore never needs: the capture side, the profile's canaries and model, the admission and its cache.
NOT_FOR_A_RESTORE = {"coldsnap_probe._capture", "coldsnap_probe._canaries", "coldsnap_probe._features",
                     "coldsnap_probe._model", "coldsnap_probe._cache", "coldsnap_probe._contracts",
                     "coldsnap_probe._quiesce", "coldsnap_probe.hydration._arena"}


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
