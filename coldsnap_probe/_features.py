"""The host feature profile: IDs, validation, requirements, admission, CRIU attachment, qualification.

Everything here works on plain JSON values (dicts and lists), decoded strictly: an
unknown key, a wrong type or a bool where a number belongs is a ProfileError naming it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = (
    "FEATURE_IDS",
    "PROFILE_KIND",
    "STATUSES",
    "AdmissionError",
    "ProfileError",
    "admit",
    "apply_qualification",
    "attach_criu",
    "decode_profile",
    "validate_profile",
    "validate_qualification",
    "validate_requirements",
)

PROFILE_KIND = "coldsnap-host-feature-profile"
QUALIFICATION_KIND = "coldsnap-qualification-record"

# Go `knownFeatures` order.
FEATURE_IDS: tuple[str, ...] = (
    "criu-process-template",
    "criu-process-tree",
    "cuda-fresh-state",
    "cuda-initialized-state",
    "cuda-checkpoint-api",
    "cuda-checkpoint-roundtrip",
    "cuda-classic-ipc",
    "cuda-vmm-exact-address",
    "cuda-uvm-checkpoint",
    "cuda-vmm-exported-handle-checkpoint",
    "nccl-communicator-suspend-in-place",
    "nccl-transport-detach-in-place",
    "nccl-graph-resource-retention",
    "nccl-registration-window-in-place-replay",
    "nccl-nvls-in-place-replay",
    "nccl-device-api-state-retention",
)
_KNOWN = frozenset(FEATURE_IDS)
STATUSES = ("passed", "failed", "unsupported", "unqualified")

_PROFILE_KEYS = {"format", "kind", "identity", "features", "started_unix", "completed_unix"}
_RESULT_KEYS = {"id", "status", "probe", "failure_phase", "reason", "seconds", "evidence"}
_RESULT_REQUIRED = {"id", "status", "probe", "seconds"}


class ProfileError(ValueError):
    """A profile, requirement list or qualification record is malformed (the message names the rule)."""


class AdmissionError(Exception):
    """A required feature did not pass; the message is the controller's exact text."""


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_keys(obj: Any, allowed: set[str], required: set[str], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProfileError(f"{where} must be a JSON object")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ProfileError(f"{where} has unknown fields: {', '.join(unknown)}")
    missing = sorted(required - set(obj))
    if missing:
        raise ProfileError(f"{where} is missing required fields: {', '.join(missing)}")
    return obj


def validate_result(value: Any, where: str) -> dict[str, Any]:
    result = _check_keys(value, _RESULT_KEYS, _RESULT_REQUIRED, where)
    for key in ("id", "status", "probe", "failure_phase", "reason"):
        if key in result and not isinstance(result[key], str):
            raise ProfileError(f"{where}.{key} must be a string")
    if result["id"] not in _KNOWN:
        raise ProfileError(f"{where}.id {result['id']!r} is not a known feature ID")
    if result["status"] not in STATUSES:
        raise ProfileError(f"{where}.status {result['status']!r} is not one of {', '.join(STATUSES)}")
    if not result["probe"]:
        raise ProfileError(f"{where}.probe must be non-empty")
    if not _is_number(result["seconds"]) or result["seconds"] < 0:
        raise ProfileError(f"{where}.seconds must be a number >= 0")
    if result["status"] != "passed" and not result.get("reason"):
        raise ProfileError(f"{where}.reason must be non-empty for status {result['status']}")
    if "evidence" in result and not isinstance(result["evidence"], dict):
        raise ProfileError(f"{where}.evidence must be an object")
    return result


def validate_profile(value: Any) -> dict[str, Any]:
    """Spec 1.5, in its order. Returns the profile unchanged."""
    profile = _check_keys(value, _PROFILE_KEYS, _PROFILE_KEYS, "profile")
    if profile["format"] != 1 or isinstance(profile["format"], bool):
        raise ProfileError("profile.format must be 1")
    if profile["kind"] != PROFILE_KIND:
        raise ProfileError(f"profile.kind must be {PROFILE_KIND!r}")
    if not isinstance(profile["identity"], dict) or not profile["identity"]:
        raise ProfileError("profile.identity must be a non-empty object")
    started, completed = profile["started_unix"], profile["completed_unix"]
    if not _is_number(started) or started < 0:
        raise ProfileError("profile.started_unix must be a number >= 0")
    if not _is_number(completed) or completed < started:
        raise ProfileError("profile.completed_unix must be a number >= started_unix")
    if not isinstance(profile["features"], list):
        raise ProfileError("profile.features must be a list")
    seen: set[str] = set()
    for index, result in enumerate(profile["features"]):
        validate_result(result, f"profile.features[{index}]")
        if result["id"] in seen:
            raise ProfileError(f"profile.features[{index}].id {result['id']!r} is duplicated")
        seen.add(result["id"])
    return profile


def decode_profile(data: bytes | str) -> dict[str, Any]:
    """Strictly decode one profile JSON document (no trailing data) and validate it."""
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ProfileError(f"profile is not valid JSON: {exc}") from None
    return validate_profile(value)


def validate_requirements(requirements: Any) -> list[str]:
    """`{"format": 1, "features": [{"id": ...}, ...]}`: known, strictly ascending, unique."""
    requirements = _check_keys(requirements, {"format", "features"}, {"format", "features"}, "requirements")
    if requirements["format"] != 1 or isinstance(requirements["format"], bool):
        raise ProfileError("requirements.format must be 1")
    features = requirements["features"]
    if not isinstance(features, list) or not features:
        raise ProfileError("requirements.features must be a non-empty list")
    ids: list[str] = []
    for index, item in enumerate(features):
        item = _check_keys(item, {"id"}, {"id"}, f"requirements.features[{index}]")
        if item["id"] not in _KNOWN:
            raise ProfileError(f"requirements.features[{index}].id {item['id']!r} is not a known feature ID")
        if ids and item["id"] <= ids[-1]:
            raise ProfileError("requirements.features must be strictly ascending without duplicates")
        ids.append(item["id"])
    return ids


def admit(requirements: Any, profile: Any) -> None:
    """Go `Requirements.Admit`: the first required feature that did not pass raises AdmissionError."""
    required = validate_requirements(requirements)
    validate_profile(profile)
    results = {r["id"]: r for r in profile["features"]}
    for feature in required:
        result = results.get(feature)
        if result is None:
            raise AdmissionError(
                f"required feature {feature} is unqualified: destination profile contains no result")
        if result["status"] != "passed":
            message = result.get("reason", "")
            if result.get("failure_phase"):
                message = f"phase {result['failure_phase']}: {message}"
            raise AdmissionError(f"required feature {feature} is {result['status']}: {message}")


def attach_criu(profile: dict[str, Any], driver: str) -> dict[str, Any]:
    """Spec 2.8: a passed capsule `criu check` makes the driver's structural CRIU feature passed."""
    structural = "criu-process-template" if driver == "n580" else "criu-process-tree"
    features = []
    for result in profile["features"]:
        if result["id"] == structural:
            evidence = {"evidence": result["evidence"]} if "evidence" in result else {}
            result = {"id": structural, "status": "passed", "probe": "capsule-criu-check-v1",
                      "seconds": result["seconds"], **evidence}
        features.append(result)
    attached = {**profile, "features": features}
    return validate_profile(attached)


def validate_qualification(value: Any) -> dict[str, Any]:
    keys = {"format", "kind", "id", "accepted", "environment", "scope", "features", "unchanged_artifact_restores"}
    record = _check_keys(value, keys, keys, "qualification")
    if record["format"] != 1 or isinstance(record["format"], bool):
        raise ProfileError("qualification.format must be 1")
    if record["kind"] != QUALIFICATION_KIND:
        raise ProfileError(f"qualification.kind must be {QUALIFICATION_KIND!r}")
    if not isinstance(record["id"], str) or not record["id"]:
        raise ProfileError("qualification.id must be non-empty")
    if record["accepted"] is not True:
        raise ProfileError("qualification.accepted must be true")
    if not isinstance(record["environment"], dict) or not record["environment"]:
        raise ProfileError("qualification.environment must be a non-empty object")
    scope_keys = {"engine", "model_family", "connector", "topology_sha256", "graph_mode", "transport",
                  "nccl_provider"}
    scope = _check_keys(record["scope"], scope_keys, scope_keys, "qualification.scope")
    for key in sorted(scope_keys - {"connector"}):
        if not isinstance(scope[key], str) or not scope[key]:
            raise ProfileError(f"qualification.scope.{key} must be non-empty")
    restores = record["unchanged_artifact_restores"]
    if not isinstance(restores, int) or isinstance(restores, bool) or restores < 2:
        raise ProfileError("qualification.unchanged_artifact_restores must be an integer >= 2")
    features = record["features"]
    if not isinstance(features, list) or not features:
        raise ProfileError("qualification.features must be a non-empty list")
    for index, feature in enumerate(features):
        if feature not in _KNOWN:
            raise ProfileError(f"qualification.features[{index}] {feature!r} is not a known feature ID")
        if index and feature <= features[index - 1]:
            raise ProfileError("qualification.features must be strictly sorted without duplicates")
    return record


def apply_qualification(profile: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Spec 5.6: qualify `unqualified`/absent features for the exact environment; never override a negative."""
    validate_profile(profile)
    validate_qualification(record)
    if json.loads(json.dumps(profile["identity"])) != json.loads(json.dumps(record["environment"])):
        raise ProfileError("qualification environment does not equal the profile identity exactly")
    results = {r["id"]: r for r in profile["features"]}
    probe = f"qualification:{record['id']}"
    for feature in record["features"]:
        current = results.get(feature)
        if current is None or current["status"] == "unqualified":
            results[feature] = {"id": feature, "status": "passed", "probe": probe, "seconds": 0.0}
        elif current["status"] in ("failed", "unsupported"):
            raise ProfileError(f"qualification cannot override {feature}, which is {current['status']} on this host")
    qualified = {**profile, "features": [results[k] for k in sorted(results)]}
    return validate_profile(qualified)
