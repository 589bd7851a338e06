"""The ctypes binding (`_lib.py`): the real shim's lifecycle guards, and its one translation of results."""

from __future__ import annotations

import pytest

from nccl_shim._lib import Shim, _check
from nccl_shim.errors import AbiMismatch, ShimCallFailed, ShimError
from tests.shim._support import ID_231, IN_PLACE_ENV, inspect, lifecycle


def test_in_place_lifecycle_guards_state_before_touching_the_provider(providers: dict[str, str]) -> None:
    steps = lifecycle(providers["v2_31"], "in-place", {**ID_231, **IN_PLACE_ENV})
    assert steps["resume-first"]["result"]["shim_error"] == -4 and steps["resume-first"]["calls"] == 0
    assert steps["suspend"]["result"] == 0 and steps["suspend"]["state"] == ["suspended", "idle"]
    assert steps["suspend-again"]["result"]["shim_error"] == -4 and steps["suspend-again"]["calls"] == 1
    assert steps["prepare-while-suspended"]["result"]["shim_error"] == -4
    assert steps["detach"]["state"] == ["transport-detached", "idle"]
    assert steps["evidence-detached"]["result"]["state"] == "transport-detached"
    assert steps["evidence-detached"]["result"]["qualified"] is False
    assert steps["resume"]["result"] == 0 and steps["resume"]["calls"] == 4
    assert steps["evidence-active"]["result"]["generation"] == 1
    assert steps["evidence-wrong-state"]["result"]["admission_error"] == "4b"


def test_recreate_lifecycle_guards(providers: dict[str, str]) -> None:
    steps = lifecycle(providers["v2_31"], "recreate", ID_231)
    assert steps["restore-first"]["result"]["shim_error"] == -4 and steps["restore-first"]["calls"] == 0
    assert steps["prepare"]["result"] == 0 and steps["prepare"]["state"] == ["active", "prepared"]
    assert steps["prepare-again"]["result"]["shim_error"] == -4
    assert steps["suspend-while-prepared"]["result"]["shim_error"] == -4
    assert steps["network-reset"]["result"] == 0 and steps["restore"]["result"] == 0
    assert steps["restore-again"]["result"]["shim_error"] == -4  # terminal after the first attempt
    assert steps["restore-again"]["calls"] == 3


def test_evidence_over_64k_and_malformed_evidence_are_refused(providers: dict[str, str]) -> None:
    env = {**ID_231, **IN_PLACE_ENV}
    huge = lifecycle(providers["huge_evidence"], "evidence", env)["evidence"]["result"]
    assert huge["shim_error"] == -8 and "evidence exceeds 65536 bytes" in huge["message"]
    bad = lifecycle(providers["bad_evidence"], "evidence", env)["evidence"]["result"]
    assert bad["admission_error"] == "4b" and "not UTF-8 JSON" in bad["message"]


def test_resources_inventory_admission(providers: dict[str, str]) -> None:
    steps = lifecycle(providers["resources"], "resources", ID_231)
    assert steps["recreate"]["result"]["admitted"] is True and steps["in-place"]["result"]["mode"] == "in-place"
    assert steps["bad-mode"]["result"][0] == 4
    assert steps["mode-mismatch"]["result"]["admission_error"] == "4c"
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
