"""The ctypes binding (`_lib.py`): the tables it describes, and its one translation of results."""

from __future__ import annotations

import pytest

from nccl_shim._lib import Shim, _check
from nccl_shim.errors import AbiMismatch, ShimCallFailed, ShimError
from tests.shim._support import ID_231, inspect


def test_inspect_reports_the_resources_table(providers: dict[str, str]) -> None:
    _, report = inspect(providers["resources"], env=ID_231)
    assert report["resources"]["status"] == "present" and report["resources"]["slots"] == ["inspect", "evidence_json"]


@pytest.mark.parametrize(("rc", "cls", "meaning"), [
    (-6, AbiMismatch, "table truncated"), (-7, AbiMismatch, "ABI major mismatch"),
    (-4, ShimCallFailed, "wrong lifecycle state"), (5, ShimCallFailed, "ncclInvalidUsage"),
    (-99, ShimCallFailed, "shim error -99"),
])
def test_results_are_translated_to_the_most_specific_class(rc: int, cls: type[ShimError], meaning: str) -> None:
    with pytest.raises(cls, match=meaning) as info:
        _check("csns_in_place_info", rc)
    assert type(info.value) is cls and info.value.code == rc  # type: ignore[attr-defined]
    _check("csns_in_place_info", 0)  # success raises nothing


def test_a_shim_that_cannot_be_loaded_is_a_shim_error_chained_to_the_loader(tmp_path: object) -> None:
    with pytest.raises(ShimCallFailed, match="could not be loaded") as info:
        Shim(None, shim_path="/nonexistent/libcsns.so")
    assert isinstance(info.value.__cause__, OSError) and info.value.code == -2
