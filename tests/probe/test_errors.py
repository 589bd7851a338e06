"""coldsnap_probe's one error tree (`errors.py`) and its one CUDA translation edge (`_cuda.py`)."""

from __future__ import annotations

import ast
import builtins
import inspect

import pytest

from coldsnap_probe import errors
from coldsnap_probe._cuda import Driver
from tests.helpers import ROOT
from tests.probe.test_main import has_nvidia_driver

CLASSES = [getattr(errors, name) for name in errors.__all__]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_is_in_the_tree_drawn_in_the_docstring(cls: type[Exception]) -> None:
    assert issubclass(cls, errors.ProbeError)
    doc = inspect.getdoc(cls) or ""
    assert doc and "\n" not in doc, f"{cls.__name__} needs a one-line docstring"
    drawn = [line for line in (errors.__doc__ or "").splitlines() if f" {cls.__name__} " in f"{line} "]
    assert drawn, f"{cls.__name__} is missing from the tree in errors.__doc__"


def test_the_drawn_tree_matches_the_classes() -> None:
    """Each drawn name sits under the class one indentation level up."""
    stack: list[tuple[int, str]] = []
    drawn: set[str] = set()
    for line in (errors.__doc__ or "").splitlines():
        stripped = line.lstrip(" │├└─")
        if not stripped or not stripped[0].isupper() or "  " not in stripped:
            continue
        name, depth = stripped.split()[0], len(line) - len(stripped)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            assert getattr(errors, stack[-1][1]) in getattr(errors, name).__bases__, name
        stack.append((depth, name))
        drawn.add(name)
    assert drawn == set(errors.__all__)


def test_no_module_raises_a_built_in_exception() -> None:
    """Built-in exceptions are not private signals here: every raise names a class of the tree (but a module's
    `__getattr__`, whose AttributeError is Python's protocol for a missing name, PEP 562)."""
    names = set(dir(builtins)) - {"SystemExit"}
    for path in sorted((ROOT / "coldsnap_probe").glob("*.py")):
        tree = ast.parse(path.read_text())
        protocol = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                    for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None and id(node) not in protocol:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                assert not (isinstance(exc, ast.Name) and exc.id in names), f"{path.name}:{node.lineno} raises {exc.id}"


def test_cuda_error_builds_the_spec_text() -> None:
    exc = errors.CudaError("cuInit", "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected")
    assert str(exc) == "cuInit failed: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected"
    assert (exc.function, exc.error_name) == ("cuInit", "CUDA_ERROR_NO_DEVICE")


def test_feature_not_passed_builds_the_controllers_text() -> None:
    assert str(errors.FeatureNotPassed("cuda-classic-ipc", status="failed", reason="X", failure_phase="open")) == \
        "required feature cuda-classic-ipc is failed: phase open: X"
    assert str(errors.FeatureNotPassed("cuda-fresh-state", status="unsupported", reason="none")) == \
        "required feature cuda-fresh-state is unsupported: none"


def test_capture_refused_names_each_process_its_command_and_its_handles() -> None:
    exc = errors.CaptureRefused([{"code": "cuda-ipc", "pid": 41, "command": "python -m engine", "exported":
                                  {"count": 1, "bytes": 67108864}, "imported": {"count": 0, "bytes": 0}}])
    assert str(exc) == ("capture refused before anything was locked or released: cuda-ipc (process 41 "
                        "`python -m engine`: exported {'count': 1, 'bytes': 67108864}, imported {'count': 0, "
                        "'bytes': 0})")
    assert exc.reasons[0]["pid"] == 41 and isinstance(exc, errors.WorkerError)


@pytest.mark.skipif(has_nvidia_driver(), reason="asserts the no-driver translation")
def test_a_missing_libcuda_is_translated_once_and_chained() -> None:
    with pytest.raises(errors.CudaLibraryMissing, match=r"libcuda\.so\.1 could not be loaded") as info:
        Driver()
    assert isinstance(info.value.__cause__, OSError)
    assert isinstance(info.value, errors.DriverError)
