"""Admission texts, CRIU attachment and qualification records (`_features.py`), typed and at the JSON edge."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from coldsnap_probe import (
    CONTRACTS,
    Profile,
    admit,
    admit_profile,
    apply_qualification,
    attach_criu,
    decode_profile,
    requirements,
    with_criu,
)
from coldsnap_probe.errors import AdmissionError, FeatureNotPassed, ProfileError


def result(feature: str, status: str = "passed", **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"id": feature, "status": status, "probe": "p", "seconds": 0.1}
    if status != "passed":
        base["reason"] = "because"
    return {**base, **extra}


def profile(*results: dict[str, Any]) -> dict[str, Any]:
    return {"format": 1, "kind": "coldsnap-host-feature-profile", "identity": {"boot_id": "b"},
            "features": list(results), "started_unix": 1.0, "completed_unix": 2.0}


N610_PASSING = profile(*(result(f) for f in CONTRACTS["n610"].base_requirements.features))


def test_admission_passes_when_every_requirement_passed() -> None:
    admit(requirements("n610"), N610_PASSING)


def test_admission_reports_missing_feature_as_unqualified() -> None:
    with pytest.raises(FeatureNotPassed) as info:
        admit(requirements("n580"), profile(result("cuda-fresh-state")))
    assert str(info.value) == \
        "required feature criu-process-template is unqualified: destination profile contains no result"
    assert (info.value.feature, info.value.status, info.value.absent) == ("criu-process-template", "unqualified", True)


def test_admission_keeps_the_four_states_and_the_phase() -> None:
    failing = copy.deepcopy(N610_PASSING)
    for feature in failing["features"]:
        if feature["id"] == "cuda-classic-ipc":
            feature.update(status="failed", failure_phase="open", reason="CUDA_ERROR_INVALID_HANDLE")
    with pytest.raises(AdmissionError) as info:
        admit(requirements("n610"), failing)
    assert str(info.value) == "required feature cuda-classic-ipc is failed: phase open: CUDA_ERROR_INVALID_HANDLE"
    unsupported = copy.deepcopy(N610_PASSING)
    unsupported["features"][0].update(status="unsupported", reason="no symbols")
    with pytest.raises(AdmissionError, match=r"^required feature criu-process-tree is unsupported: no symbols$"):
        admit(requirements("n610"), unsupported)


def test_admission_of_a_malformed_profile_is_a_profile_error_not_an_admission() -> None:
    with pytest.raises(ProfileError, match=r"profile\.kind"):
        admit(requirements("n610"), {**N610_PASSING, "kind": "x"})


def test_typed_admission_equals_the_json_edge() -> None:
    typed = Profile.from_json(N610_PASSING)
    admit_profile(requirements("n610"), typed)
    with pytest.raises(FeatureNotPassed, match="criu-process-template is unqualified"):
        admit_profile(requirements("n580"), typed)


def test_decode_profile_refuses_trailing_data_and_chains_the_json_error() -> None:
    with pytest.raises(ProfileError, match="profile is not valid JSON") as info:
        decode_profile(b'{"format": 1} {}')
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(("driver", "structural", "other"), [("n580", "criu-process-template", "criu-process-tree"),
                                                              ("n610", "criu-process-tree", "criu-process-template")])
def test_criu_attachment_passes_only_the_drivers_structural_feature(driver: str, structural: str,
                                                                    other: str) -> None:
    unqualified = profile(result(structural, "unqualified", probe="capsule-criu-check-v1", seconds=0.0),
                          result(other, "unqualified", probe="capsule-criu-check-v1", seconds=0.0))
    attached = attach_criu(unqualified, driver)
    by_id = {f["id"]: f for f in attached["features"]}
    assert by_id[structural] == {"id": structural, "status": "passed", "probe": "capsule-criu-check-v1", "seconds": 0.0}
    assert by_id[other]["status"] == "unqualified"
    assert attach_criu(attached, driver) == attached  # idempotent
    assert with_criu(Profile.from_json(unqualified), driver).to_json() == attached


def test_criu_attachment_keeps_evidence_and_seconds() -> None:
    tree = result("criu-process-tree", "unqualified", failure_phase="x", seconds=3, evidence={"criu": "3.19"})
    attached = attach_criu(profile(tree), "n610")["features"][0]
    assert attached == {"id": "criu-process-tree", "status": "passed", "probe": "capsule-criu-check-v1",
                        "seconds": 3, "evidence": {"criu": "3.19"}}


def qualification(**extra: Any) -> dict[str, Any]:
    record = {"format": 1, "kind": "coldsnap-qualification-record", "id": "q1", "accepted": True,
              "environment": {"boot_id": "b"},
              "scope": {"engine": "vllm", "model_family": "llama", "connector": "", "topology_sha256": "t",
                        "graph_mode": "g", "transport": "ib", "nccl_provider": "nccl-2.28.9-1+coldsnap.1"},
              "features": ["criu-process-tree", "nccl-transport-detach-in-place"],
              "unchanged_artifact_restores": 2}
    return {**record, **extra}


def test_qualification_promotes_unqualified_and_absent_features() -> None:
    base = profile(result("criu-process-tree", "unqualified"), result("cuda-fresh-state"))
    qualified = apply_qualification(base, qualification())
    assert [f["id"] for f in qualified["features"]] == [
        "criu-process-tree", "cuda-fresh-state", "nccl-transport-detach-in-place"]
    assert qualified["features"][0] == {"id": "criu-process-tree", "status": "passed", "probe": "qualification:q1",
                                        "seconds": 0.0}


def test_qualification_never_overrides_a_negative_or_another_environment() -> None:
    with pytest.raises(ProfileError, match="cannot override criu-process-tree, which is failed"):
        apply_qualification(profile(result("criu-process-tree", "failed")), qualification())
    with pytest.raises(ProfileError, match="environment does not equal"):
        apply_qualification(profile(result("cuda-fresh-state")), qualification(environment={"boot_id": "other"}))


@pytest.mark.parametrize("field", ["accepted", "unchanged_artifact_restores", "features", "scope"])
def test_qualification_validation(field: str) -> None:
    bad = {"accepted": False, "unchanged_artifact_restores": 1, "features": ["cuda-fresh-state", "criu-process-tree"],
           "scope": {}}[field]
    with pytest.raises(ProfileError, match=field):
        apply_qualification(profile(result("cuda-fresh-state")), qualification(**{field: bad}))
