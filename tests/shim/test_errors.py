"""nccl_shim's one error tree (`errors.py`)."""

from __future__ import annotations

import ast
import builtins
import inspect

import pytest

from nccl_shim import errors
from tests.helpers import ROOT

CLASSES = [getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_is_under_the_root_with_a_one_line_docstring_and_drawn(cls: type[Exception]) -> None:
    assert issubclass(cls, errors.ShimError)
    doc = inspect.getdoc(cls) or ""
    assert doc and "\n" not in doc
    assert f" {cls.__name__} " in (errors.__doc__ or "")


def test_no_module_raises_a_built_in_exception() -> None:
    names = set(dir(builtins)) - {"SystemExit"}
    for path in sorted((ROOT / "nccl_shim").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                assert not (isinstance(exc, ast.Name) and exc.id in names), f"{path.name}:{node.lineno} raises {exc.id}"


def test_provider_admission_is_not_the_host_feature_admission() -> None:
    """One concept per meaning: the NCCL provider's admission and a profile's admission are different classes."""
    from coldsnap_probe.errors import AdmissionError

    assert not issubclass(errors.ProviderNotAdmitted, AdmissionError)
    assert errors.ProviderNotAdmitted("4a.3", "truncated").rule == "4a.3"
