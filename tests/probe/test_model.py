"""The typed probe values (`_model.py`): strict decoding, the cross-field rules, and lossless JSON."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coldsnap_probe import FEATURE_IDS, STATUSES, FeatureResult, Profile, Requirements, validate_profile
from coldsnap_probe.canonical import canonical_json
from coldsnap_probe.errors import ProfileError
from tests.probe.test_features import profile, result


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
        (lambda p: p.pop("identity"), "missing required fields: identity"),
        (lambda p: p.update(features={}), "profile.features must be a list"),
        (lambda p: p["features"].append(result("nope")), "is not a known feature ID"),
        (lambda p: p["features"].append(result("cuda-fresh-state")), "features[1].id 'cuda-fresh-state' is duplicated"),
        (lambda p: p["features"][0].update(probe=""), "probe must be non-empty"),
        (lambda p: p["features"][0].update(probe=1), "features[0].probe must be a string"),
        (lambda p: p["features"][0].update(seconds=-1), "seconds must be a number >= 0"),
        (lambda p: p["features"][0].update(seconds=True), "seconds must be a number >= 0"),
        (lambda p: p["features"][0].update(status="maybe"), "is not one of"),
        (lambda p: p["features"][0].update(status="failed"), "reason must be non-empty for status failed"),
        (lambda p: p["features"][0].update(debug=1), "unknown fields: debug"),
        (lambda p: p["features"][0].update(evidence=[]), "evidence must be an object"),
    ],
)
def test_profile_validation_rules(mutate: Any, message: str) -> None:
    bad = copy.deepcopy(profile(result("cuda-fresh-state")))
    mutate(bad)
    with pytest.raises(ProfileError, match=message.replace("[", r"\[")):
        validate_profile(bad)


def test_a_profile_built_in_python_is_checked_too() -> None:
    """The rules are on the type, so the probe's own results cannot produce an invalid profile."""
    bad = FeatureResult(id="cuda-fresh-state", status="failed", probe="p", seconds=0.0)
    with pytest.raises(ProfileError, match=r"profile.features\[0\].reason must be non-empty"):
        Profile(identity={"boot_id": "b"}, features=(bad,), started_unix=1.0, completed_unix=2.0)
    good = dataclasses.replace(bad, reason="why")
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.status = "passed"  # type: ignore[misc]


def test_json_round_trip_is_lossless_key_presence_and_number_tokens_included() -> None:
    """What the controller sent comes back byte for byte in canonical JSON (cache files, digests, replies)."""
    document = profile(result("cuda-fresh-state", seconds=0), result("cuda-classic-ipc", "failed", failure_phase="",
                                                                        reason="r", seconds=1.5e-05),
                       result("cuda-vmm-exact-address", evidence={"address": 2**47, "nested": {"b": [1.0, None]}}))
    document["started_unix"], document["completed_unix"] = 0, 1795981945.7821665
    again = Profile.from_json(json.loads(json.dumps(document))).to_json()
    assert canonical_json(again) == canonical_json(document)
    assert "failure_phase" in again["features"][1] and "failure_phase" not in again["features"][0]


def test_to_json_hands_out_copies() -> None:
    typed = Profile.from_json(profile(result("cuda-vmm-exact-address", evidence={"a": 1})))
    typed.to_json()["features"][0]["evidence"]["a"] = 2
    typed.to_json()["identity"]["boot_id"] = "changed"
    assert typed.to_json() == profile(result("cuda-vmm-exact-address", evidence={"a": 1}))


@pytest.mark.parametrize(("value", "message"), [
    ({"format": 1, "features": []}, "non-empty list"),
    ({"format": 1, "features": [{"id": "cuda-fresh-state"}, {"id": "criu-process-tree"}]}, "strictly ascending"),
    ({"format": 1, "features": [{"id": "x"}]}, r"features\[0\].id 'x' is not a known feature ID"),
    ({"format": 2, "features": [{"id": "cuda-fresh-state"}]}, "requirements.format must be 1"),
    ({"format": 1, "features": [{"id": "cuda-fresh-state", "x": 1}]}, "unknown fields: x"),
    ({"features": [{"id": "cuda-fresh-state"}]}, "missing required fields: format"),
])
def test_requirements_must_be_known_sorted_and_unique(value: Any, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        Requirements.from_json(value)


def test_requirements_json_round_trip() -> None:
    value = {"format": 1, "features": [{"id": "criu-process-tree"}, {"id": "cuda-fresh-state"}]}
    assert Requirements.from_json(value).to_json() == value


results = st.builds(
    FeatureResult, id=st.sampled_from(FEATURE_IDS), status=st.sampled_from(STATUSES), probe=st.text(min_size=1),
    seconds=st.floats(min_value=0, allow_nan=False, allow_infinity=False) | st.integers(min_value=0),
    failure_phase=st.none() | st.text(), reason=st.text(min_size=1),
    evidence=st.none() | st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3))


@given(st.lists(results, max_size=16, unique_by=lambda r: r.id))
def test_every_valid_profile_survives_to_json_and_back(features: list[FeatureResult]) -> None:
    typed = Profile(identity={"boot_id": "b"}, features=tuple(features), started_unix=1.0, completed_unix=2.0)
    document = json.loads(json.dumps(typed.to_json()))
    assert Profile.from_json(document) == typed
    assert canonical_json(Profile.from_json(document).to_json()) == canonical_json(document)
