"""The typed probe values (spec 1-3, 5.6) and their one conversion to and from JSON.

Every value here is a frozen dataclass. `from_json` is the only way in from JSON: it
decodes strictly (an unknown key, a missing key, a wrong type or a bool where a number
belongs is a ProfileError naming it). `to_json` is the only way out: it gives exactly the
JSON the controller expects (optional keys omitted when absent, numbers as they came), so
canonical JSON, the cache file and the profile cache key never depend on this module.
Cross-field rules live in `__post_init__`, so a value built in Python is checked too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .errors import ProfileError

__all__ = (
    "FEATURE_IDS",
    "PROFILE_KIND",
    "QUALIFICATION_KIND",
    "STATUSES",
    "Contract",
    "FeatureResult",
    "Profile",
    "Qualification",
    "QualificationScope",
    "Requirements",
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


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_format_1(value: Any) -> bool:
    return value == 1 and not isinstance(value, bool)


def _object(value: Any, keys: frozenset[str], required: frozenset[str], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where} must be a JSON object")
    if unknown := sorted(set(value) - keys):
        raise ProfileError(f"{where} has unknown fields: {', '.join(unknown)}")
    if missing := sorted(required - set(value)):
        raise ProfileError(f"{where} is missing required fields: {', '.join(missing)}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class FeatureResult:
    """One feature's result (spec 1.2). `None` means the optional key is absent from the JSON."""

    id: str
    status: str
    probe: str
    seconds: float
    failure_phase: str | None = None
    reason: str | None = None
    evidence: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def check(self, where: str) -> None:
        """The value rules of spec 1.5 for one result; `where` names it in the message."""
        if self.id not in _KNOWN:
            raise ProfileError(f"{where}.id {self.id!r} is not a known feature ID")
        if self.status not in STATUSES:
            raise ProfileError(f"{where}.status {self.status!r} is not one of {', '.join(STATUSES)}")
        if not self.probe:
            raise ProfileError(f"{where}.probe must be non-empty")
        if not _is_number(self.seconds) or self.seconds < 0:
            raise ProfileError(f"{where}.seconds must be a number >= 0")
        if self.status != "passed" and not self.reason:
            raise ProfileError(f"{where}.reason must be non-empty for status {self.status}")

    @classmethod
    def from_json(cls, value: Any, where: str = "feature") -> FeatureResult:
        keys = frozenset({"id", "status", "probe", "failure_phase", "reason", "seconds", "evidence"})
        obj = _object(value, keys, frozenset({"id", "status", "probe", "seconds"}), where)
        for key in ("id", "status", "probe", "failure_phase", "reason"):
            if key in obj and not isinstance(obj[key], str):
                raise ProfileError(f"{where}.{key} must be a string")
        if "evidence" in obj and not isinstance(obj["evidence"], dict):
            raise ProfileError(f"{where}.evidence must be an object")
        result = cls(id=obj["id"], status=obj["status"], probe=obj["probe"], seconds=obj["seconds"],
                     failure_phase=obj.get("failure_phase"), reason=obj.get("reason"),
                     evidence=copy.deepcopy(obj.get("evidence")))
        result.check(where)
        return result

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "status": self.status, "probe": self.probe}
        if self.failure_phase is not None:
            out["failure_phase"] = self.failure_phase
        if self.reason is not None:
            out["reason"] = self.reason
        out["seconds"] = self.seconds
        if self.evidence is not None:
            out["evidence"] = copy.deepcopy(self.evidence)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """The format-1 host feature profile (spec 1.1); `identity` is the free-form map the probe fills."""

    identity: dict[str, Any]
    features: tuple[FeatureResult, ...]
    started_unix: float
    completed_unix: float
    format: int = 1
    kind: str = PROFILE_KIND

    def __post_init__(self) -> None:
        """Spec 1.5, in its order."""
        if not _is_format_1(self.format):
            raise ProfileError("profile.format must be 1")
        if self.kind != PROFILE_KIND:
            raise ProfileError(f"profile.kind must be {PROFILE_KIND!r}")
        if not isinstance(self.identity, dict) or not self.identity:
            raise ProfileError("profile.identity must be a non-empty object")
        if not _is_number(self.started_unix) or self.started_unix < 0:
            raise ProfileError("profile.started_unix must be a number >= 0")
        if not _is_number(self.completed_unix) or self.completed_unix < self.started_unix:
            raise ProfileError("profile.completed_unix must be a number >= started_unix")
        seen: set[str] = set()
        for index, result in enumerate(self.features):
            result.check(f"profile.features[{index}]")
            if result.id in seen:
                raise ProfileError(f"profile.features[{index}].id {result.id!r} is duplicated")
            seen.add(result.id)

    def result(self, feature: str) -> FeatureResult | None:
        return next((r for r in self.features if r.id == feature), None)

    @classmethod
    def from_json(cls, value: Any) -> Profile:
        keys = frozenset({"format", "kind", "identity", "features", "started_unix", "completed_unix"})
        obj = _object(value, keys, keys, "profile")
        if not _is_format_1(obj["format"]):  # before the features, as the controller checks
            raise ProfileError("profile.format must be 1")
        if not isinstance(obj["features"], list):
            raise ProfileError("profile.features must be a list")
        features = tuple(FeatureResult.from_json(item, f"profile.features[{index}]")
                         for index, item in enumerate(obj["features"]))
        return cls(format=obj["format"], kind=obj["kind"], identity=copy.deepcopy(obj["identity"]),
                   features=features, started_unix=obj["started_unix"], completed_unix=obj["completed_unix"])

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "kind": self.kind, "identity": copy.deepcopy(self.identity),
                "features": [r.to_json() for r in self.features], "started_unix": self.started_unix,
                "completed_unix": self.completed_unix}


@dataclass(frozen=True, slots=True)
class Requirements:
    """`{"format": 1, "features": [{"id": ...}, ...]}` (spec 1.6, 5.2): known, strictly ascending, non-empty."""

    features: tuple[str, ...]
    format: int = 1

    def __post_init__(self) -> None:
        if not _is_format_1(self.format):
            raise ProfileError("requirements.format must be 1")
        if not self.features:
            raise ProfileError("requirements.features must be a non-empty list")
        for index, feature in enumerate(self.features):
            if feature not in _KNOWN:
                raise ProfileError(f"requirements.features[{index}].id {feature!r} is not a known feature ID")
            if index and feature <= self.features[index - 1]:
                raise ProfileError("requirements.features must be strictly ascending without duplicates")

    @classmethod
    def from_json(cls, value: Any) -> Requirements:
        keys = frozenset({"format", "features"})
        obj = _object(value, keys, keys, "requirements")
        if not isinstance(obj["features"], list):
            raise ProfileError("requirements.features must be a non-empty list")
        ids = []
        for index, item in enumerate(obj["features"]):
            entry = _object(item, frozenset({"id"}), frozenset({"id"}), f"requirements.features[{index}]")
            if not isinstance(entry["id"], str):
                raise ProfileError(f"requirements.features[{index}].id must be a string")
            ids.append(entry["id"])
        return cls(tuple(ids), format=obj["format"])

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "features": [{"id": feature} for feature in self.features]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Contract:
    """A snapshot-driver base contract (spec 3)."""

    id: str
    abi: int
    capture_boundary: str
    minimum_nvidia_driver_major: int
    base_requirements: Requirements

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "abi": self.abi, "capture_boundary": self.capture_boundary,
                "minimum_nvidia_driver_major": self.minimum_nvidia_driver_major,
                "base_requirements": self.base_requirements.to_json()}


_SCOPE_KEYS = ("engine", "model_family", "connector", "topology_sha256", "graph_mode", "transport", "nccl_provider")


@dataclass(frozen=True, slots=True, kw_only=True)
class QualificationScope:
    """What a qualification covers; every field but `connector` must be non-empty."""

    engine: str
    model_family: str
    connector: str
    topology_sha256: str
    graph_mode: str
    transport: str
    nccl_provider: str

    def __post_init__(self) -> None:
        for key in sorted(set(_SCOPE_KEYS) - {"connector"}):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ProfileError(f"qualification.scope.{key} must be non-empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class Qualification:
    """A `coldsnap-qualification-record` (spec 5.6)."""

    id: str
    accepted: bool
    environment: dict[str, Any]
    scope: QualificationScope
    features: tuple[str, ...]
    unchanged_artifact_restores: int
    format: int = 1
    kind: str = QUALIFICATION_KIND

    def __post_init__(self) -> None:
        if not _is_format_1(self.format):
            raise ProfileError("qualification.format must be 1")
        if self.kind != QUALIFICATION_KIND:
            raise ProfileError(f"qualification.kind must be {QUALIFICATION_KIND!r}")
        if not isinstance(self.id, str) or not self.id:
            raise ProfileError("qualification.id must be non-empty")
        if self.accepted is not True:
            raise ProfileError("qualification.accepted must be true")
        if not isinstance(self.environment, dict) or not self.environment:
            raise ProfileError("qualification.environment must be a non-empty object")
        restores = self.unchanged_artifact_restores
        if not isinstance(restores, int) or isinstance(restores, bool) or restores < 2:
            raise ProfileError("qualification.unchanged_artifact_restores must be an integer >= 2")
        if not self.features:
            raise ProfileError("qualification.features must be a non-empty list")
        for index, feature in enumerate(self.features):
            if feature not in _KNOWN:
                raise ProfileError(f"qualification.features[{index}] {feature!r} is not a known feature ID")
            if index and feature <= self.features[index - 1]:
                raise ProfileError("qualification.features must be strictly sorted without duplicates")

    @classmethod
    def from_json(cls, value: Any) -> Qualification:
        keys = frozenset({"format", "kind", "id", "accepted", "environment", "scope", "features",
                          "unchanged_artifact_restores"})
        obj = _object(value, keys, keys, "qualification")
        scope = _object(obj["scope"], frozenset(_SCOPE_KEYS), frozenset(_SCOPE_KEYS), "qualification.scope")
        if not isinstance(obj["features"], list):
            raise ProfileError("qualification.features must be a non-empty list")
        return cls(format=obj["format"], kind=obj["kind"], id=obj["id"], accepted=obj["accepted"],
                   environment=copy.deepcopy(obj["environment"]), scope=QualificationScope(**scope),
                   features=tuple(obj["features"]), unchanged_artifact_restores=obj["unchanged_artifact_restores"])
