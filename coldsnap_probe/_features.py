"""Admission, CRIU attachment and qualification of host feature profiles (spec 1.6, 2.8, 5.6).

The work is done on the typed values of `_model`. The daemon only relays profiles (from
the probe's stdout to the cache file and the reply), so the public functions at the end
take and give JSON documents, converting through `Profile.from_json`/`to_json` only.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ._model import FeatureResult, Profile, Qualification, Requirements
from .errors import FeatureNotPassed, ProfileError

__all__ = (
    "admit",
    "admit_profile",
    "apply_qualification",
    "attach_criu",
    "decode_profile",
    "qualify",
    "validate_profile",
    "with_criu",
)

CRIU_PROBE = "capsule-criu-check-v1"


def admit_profile(requirements: Requirements, profile: Profile) -> None:
    """Go `Requirements.Admit`: the first required feature that did not pass raises FeatureNotPassed."""
    for feature in requirements.features:
        result = profile.result(feature)
        if result is None:
            raise FeatureNotPassed(feature, absent=True)
        if not result.passed:
            raise FeatureNotPassed(feature, status=result.status, reason=result.reason or "",
                                   failure_phase=result.failure_phase or "")


def with_criu(profile: Profile, driver: str) -> Profile:
    """Spec 2.8: a passed capsule `criu check` makes the driver's structural CRIU feature passed."""
    structural = "criu-process-template" if driver == "n580" else "criu-process-tree"
    features = tuple(
        FeatureResult(id=structural, status="passed", probe=CRIU_PROBE, seconds=r.seconds, evidence=r.evidence)
        if r.id == structural else r for r in profile.features)
    return dataclasses.replace(profile, features=features)


def qualify(profile: Profile, record: Qualification) -> Profile:
    """Spec 5.6: qualify `unqualified`/absent features for the exact environment; never override a negative."""
    if json.loads(json.dumps(profile.identity)) != json.loads(json.dumps(record.environment)):
        raise ProfileError("qualification environment does not equal the profile identity exactly")
    results = {r.id: r for r in profile.features}
    for feature in record.features:
        current = results.get(feature)
        if current is None or current.status == "unqualified":
            results[feature] = FeatureResult(id=feature, status="passed", probe=f"qualification:{record.id}",
                                             seconds=0.0)
        elif current.status in ("failed", "unsupported"):
            raise ProfileError(f"qualification cannot override {feature}, which is {current.status} on this host")
    return dataclasses.replace(profile, features=tuple(results[k] for k in sorted(results)))


# --- the JSON edge ----------------------------------------------------------------------


def validate_profile(value: Any) -> dict[str, Any]:
    """Spec 1.5: the profile as the controller would re-marshal it, or ProfileError naming the rule."""
    return Profile.from_json(value).to_json()


def decode_profile(data: bytes | str) -> dict[str, Any]:
    """Strictly decode one profile JSON document (no trailing data) and validate it."""
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ProfileError(f"profile is not valid JSON: {exc}") from exc
    return validate_profile(value)


def admit(requirements: Requirements, profile: dict[str, Any]) -> None:
    """Validate the profile document, then admit it (see `admit_profile`)."""
    admit_profile(requirements, Profile.from_json(profile))


def attach_criu(profile: dict[str, Any], driver: str) -> dict[str, Any]:
    return with_criu(Profile.from_json(profile), driver).to_json()


def apply_qualification(profile: dict[str, Any], record: Any) -> dict[str, Any]:
    """`python -m coldsnap_probe profile --qualification`: the record validated (spec 5.6), then applied."""
    return qualify(Profile.from_json(profile), Qualification.from_json(record)).to_json()
