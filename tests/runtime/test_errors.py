"""The runtime's one error tree: drawn in the docstring, every class documented, nothing outside it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import coldsnap_runtime.errors as errors
from tests.helpers import ROOT

CLASSES = [getattr(errors, name) for name in errors.__all__]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_error_class_is_in_the_tree_drawn_and_documented(cls: type[errors.ColdsnapError]) -> None:
    assert issubclass(cls, errors.ColdsnapError)
    assert cls.__doc__ and "\n" not in cls.__doc__.strip(), "one line saying when it is raised"
    assert f" {cls.__name__} " in f" {errors.__doc__} "


def test_error_codes_are_the_wire_classes() -> None:
    assert errors.RequestRejected.error_code is None
    assert errors.NotFound.error_code == "not_found" and errors.PathNotFound.error_code == "path_not_found"
    for cls in (errors.RuntimeFailed, errors.OutputTooLarge, errors.EngineRejected, errors.BuildContextError,
                errors.BackendTimeout, errors.BackendUnavailable):
        assert cls.error_code == "runtime_failed", cls


def _runtime_modules() -> list[Path]:
    # _archive.py is a separate program (run by path, standard library only), and _privileges.py is
    # the part of it that drops privileges: their private exceptions end as an exit status and a line
    # on stderr, never as a Python exception here.
    return [p for p in (ROOT / "coldsnap_runtime").rglob("*.py")
            if p.name not in ("errors.py", "_archive.py", "_privileges.py")]


def test_no_exception_class_is_defined_outside_the_tree() -> None:
    for path in _runtime_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not any(b.endswith(("Error", "Exception")) for b in bases), (path, node.name)


def test_no_builtin_exception_is_raised_as_a_private_signal() -> None:
    """Regression: #10: OverflowError carried "output too large" from _hijack and _docker."""
    for path in _runtime_modules():
        source = path.read_text()
        assert "OverflowError" not in source, path
        assert "from None" not in source, path  # every re-raise chains its cause


def test_output_too_large_names_the_limit() -> None:
    exc = errors.OutputTooLarge(action="workload-exec", limit=5)
    assert str(exc) == "workload-exec failed: output exceeds 5 bytes" and exc.limit == 5
    assert inspect.signature(errors.OutputTooLarge).parameters["limit"].kind is inspect.Parameter.KEYWORD_ONLY
