"""Profile validation, admission texts, contracts, CRIU attachment and qualification records."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from coldsnap_probe import (
    CONTRACTS,
    FEATURE_IDS,
    AdmissionError,
    ProfileError,
    admit,
    apply_qualification,
    attach_criu,
    requirements,
    validate_profile,
    validate_qualification,
)


def result(feature: str, status: str = "passed", **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"id": feature, "status": status, "probe": "p", "seconds": 0.1}
    if status != "passed":
        base["reason"] = "because"
    return {**base, **extra}


def profile(*results: dict[str, Any]) -> dict[str, Any]:
    return {"format": 1, "kind": "coldsnap-host-feature-profile", "identity": {"boot_id": "b"},
            "features": list(results), "started_unix": 1.0, "completed_unix": 2.0}


N610_PASSING = profile(*(result(f["id"]) for f in CONTRACTS["n610"]["base_requirements"]["features"]))


def test_feature_ids_are_the_sixteen_in_go_order() -> None:
    assert len(FEATURE_IDS) == 16 and FEATURE_IDS[0] == "criu-process-template"
    assert FEATURE_IDS[-1] == "nccl-device-api-state-retention"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.update(format=2), "profile.format must be 1"),
        (lambda p: p.update(format=True), "profile.format must be 1"),
        (lambda p: p.update(kind="x"), "profile.kind"),
        (lambda p: p.update(identity={}), "identity must be a non-empty object"),
        (lambda p: p.update(started_unix=-1), "started_unix"),
        (lambda p: p.update(completed_unix=0.5), "completed_unix must be a number >= started_unix"),
        (lambda p: p.update(extra=1), "unknown fields: extra"),
        (lambda p: p["features"].append(result("nope")), "is not a known feature ID"),
        (lambda p: p["features"].append(result("cuda-fresh-state")), "is duplicated"),
        (lambda p: p["features"][0].update(probe=""), "probe must be non-empty"),
        (lambda p: p["features"][0].update(seconds=-1), "seconds must be a number >= 0"),
        (lambda p: p["features"][0].update(seconds=True), "seconds must be a number >= 0"),
        (lambda p: p["features"][0].update(status="maybe"), "is not one of"),
        (lambda p: p["features"][0].update(status="failed"), "reason must be non-empty for status failed"),
        (lambda p: p["features"][0].update(debug=1), "unknown fields: debug"),
    ],
)
def test_profile_validation_rules(mutate: Any, message: str) -> None:
    bad = copy.deepcopy(profile(result("cuda-fresh-state")))
    mutate(bad)
    with pytest.raises(ProfileError, match=message.replace("[", r"\[")):
        validate_profile(bad)


def test_admission_passes_when_every_requirement_passed() -> None:
    admit(requirements("n610"), N610_PASSING)


def test_admission_reports_missing_feature_as_unqualified() -> None:
    with pytest.raises(AdmissionError) as info:
        admit(requirements("n580"), profile(result("cuda-fresh-state")))
    assert str(info.value) == \
        "required feature criu-process-template is unqualified: destination profile contains no result"


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


def test_requirements_must_be_known_sorted_and_unique() -> None:
    for bad in ({"format": 1, "features": []},
                {"format": 1, "features": [{"id": "cuda-fresh-state"}, {"id": "criu-process-tree"}]},
                {"format": 1, "features": [{"id": "x"}]},
                {"format": 2, "features": [{"id": "cuda-fresh-state"}]}):
        with pytest.raises(ProfileError):
            admit(bad, N610_PASSING)


def test_contracts_are_exact() -> None:
    assert CONTRACTS["n580"]["capture_boundary"] == "pre-cuda-process-template"
    assert [f["id"] for f in requirements("n580")["features"]] == [
        "criu-process-template", "cuda-fresh-state", "cuda-vmm-exact-address"]
    assert [f["id"] for f in requirements("n610")["features"]] == [
        "criu-process-tree", "cuda-checkpoint-api", "cuda-checkpoint-roundtrip", "cuda-classic-ipc",
        "cuda-initialized-state", "cuda-vmm-exact-address"]
    assert CONTRACTS["n610"]["minimum_nvidia_driver_major"] == 610
    with pytest.raises(ValueError, match="n580 or n610"):
        requirements("auto")


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
        validate_qualification(qualification(**{field: bad}))
