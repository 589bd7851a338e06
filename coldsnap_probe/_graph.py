"""The graph policy record (admission spec 5.4-5.5): resolution, validation and the recipe digest, and the record a
capture wrote checked before a restore (`validated_graph_record`)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn

from .canonical import digest, go_floats
from .errors import ContractError, WorkerError

if TYPE_CHECKING:  # made only for images with the record: off a restore's path to CRIU otherwise (issue 35 item 2)
    from ._reports import RestoredGraphPolicy

__all__ = ("DECISIONS", "POLICIES", "RECIPE_MODES", "GraphPlan", "GraphResolution", "ResourceAudit",
           "default_graph_policy", "graph_record", "plan_graph_policy", "recipe_digest", "resolve_graph_policy",
           "validate_graph_record", "validated_graph_record")

POLICIES = ("preserve-exec", "recreate-from-plan", "preserve-nccl-exec", "disabled")
DECISIONS = ("requested_policy_is_supported", "provider_reconstructs_communicator",
             "graph_exec_preservation_is_unqualified", "qualified_exact_nccl_in_place")
# The recipe mode of each effective policy (spec 5.4's last column).
RECIPE_MODES: MappingProxyType[str, str] = MappingProxyType({
    "disabled": "disabled", "recreate-from-plan": "engine-native-async",
    "preserve-nccl-exec": "engine-native-retained"})
SHAPE_POLICIES = ("auto", "enabled", "disabled")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_AUDIT_KEYS = ("format", "unknown_dependencies", "nccl_communicators", "registered_windows", "device_api",
               "external_semaphores", "provider_owned_allocations")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResourceAudit:
    """The record's `resource_audit` (spec 5.4); the builder fills only the first two."""

    format: int = 1
    unknown_dependencies: bool = False
    nccl_communicators: int = 0
    registered_windows: int = 0
    device_api: bool = False
    external_semaphores: int = 0
    provider_owned_allocations: int = 0

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphResolution:
    """One row of the 5.4 table: what a requested policy resolves to."""

    effective: str
    decision: str
    audit: ResourceAudit

    @property
    def mode(self) -> str:
        return RECIPE_MODES[self.effective]


def resolve_graph_policy(requested: str, workers: int) -> GraphResolution:
    """The effective policy, decision and audit for a requested policy and the number of workers."""
    if requested not in POLICIES:
        raise ContractError(f"graph policy must be one of {', '.join(POLICIES)}, got {requested!r}")
    if workers < 1:
        raise ContractError(f"workers must be >= 1, got {workers}")
    if requested == "disabled":
        return GraphResolution(effective="disabled", decision="requested_policy_is_supported",
                               audit=ResourceAudit())
    audit = ResourceAudit(unknown_dependencies=True, nccl_communicators=1 if workers > 1 else 0)
    if requested == "recreate-from-plan":
        return GraphResolution(effective="recreate-from-plan", decision="requested_policy_is_supported", audit=audit)
    if workers == 1:
        return GraphResolution(effective="recreate-from-plan", decision="graph_exec_preservation_is_unqualified",
                               audit=audit)
    if requested == "preserve-exec":
        return GraphResolution(effective="recreate-from-plan", decision="provider_reconstructs_communicator",
                               audit=audit)
    return GraphResolution(effective="preserve-nccl-exec", decision="qualified_exact_nccl_in_place",
                           audit=dataclasses.replace(audit, unknown_dependencies=False))


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphPlan:
    """What a rank does with its graphs: the policy asked for, the policy its record states, and why.

    `recorded` differs from `requested` only on a downgrade: `preserve-nccl-exec` with several workers and no
    admitted in-place NCCL provider is recorded as `recreate-from-plan` (the one record the validator accepts for
    what then happens: communicators destroyed before capture, recreated and graphs re-captured after restore).
    """

    requested: str
    recorded: str
    resolution: GraphResolution
    reason: str

    @property
    def effective(self) -> str:
        return self.resolution.effective


_REASONS = {
    "requested_policy_is_supported": "graphs are recreated from the captured plan",
    "graph_exec_preservation_is_unqualified": "one worker: no NCCL communicator to preserve",
    "provider_reconstructs_communicator": "the NCCL provider reconstructs communicators: executables are recreated",
    "qualified_exact_nccl_in_place": "exact in-place NCCL provider admitted with more than one worker",
}


def plan_graph_policy(requested: str, workers: int, *, in_place_admitted: bool,
                      in_place_reason: str = "") -> GraphPlan:
    """The table of spec 5.4 plus the one rule a rank can judge: retained NCCL needs an admitted provider."""
    resolved = resolve_graph_policy(requested, workers)
    if resolved.effective == "preserve-nccl-exec" and not in_place_admitted:
        return GraphPlan(requested=requested, recorded="recreate-from-plan",
                         resolution=resolve_graph_policy("recreate-from-plan", workers),
                         reason=f"no admitted in-place NCCL provider ({in_place_reason or 'not admitted'}): "
                                "communicators are recreated and graphs re-captured")
    reason = "asynchronous graphs are disabled" if requested == "disabled" else _REASONS[resolved.decision]
    return GraphPlan(requested=requested, recorded=requested, resolution=resolved, reason=reason)


def default_graph_policy(driver_version: str) -> str:
    """Per-driver default: the 610 series may retain NCCL graph executables in place, 580 recreates them."""
    try:
        major = int(str(driver_version).split(".")[0])
    except ValueError as exc:
        raise ContractError(f"driver version {driver_version!r} has no major number") from exc
    return "preserve-nccl-exec" if major >= 610 else "recreate-from-plan"


def recipe_digest(*, engine: str, execution: dict[str, Any], requested: str, effective: str,
                  audit: dict[str, Any], coverage: dict[str, Any] | None) -> str:
    """plan_sha256: canonical JSON of the plan inputs; Go's integral-float rule applied to struct fields."""
    value: dict[str, Any] = {"engine": engine, "execution": execution, "requested": requested,
                             "effective": effective, "audit": audit}
    if coverage is not None:
        value["shape_calibration"] = coverage
    return digest(go_floats(value))


def graph_record(*, async_graphs: bool, graph_policy: str, engine: str, execution: dict[str, Any],
                 shape_calibration_policy: str = "auto", coverage: dict[str, Any] | None = None) -> dict[str, Any]:
    """Go `NewGraphPolicyRecord`: the artifact's `graph` object."""
    requested = "disabled" if not async_graphs else (graph_policy or "recreate-from-plan")
    workers = len(execution.get("workers", []))
    resolved = resolve_graph_policy(requested, workers)
    audit = resolved.audit.to_json()
    units = len(coverage.get("units", [])) if coverage else 0
    return {
        "format": 1, "policy_requested": requested, "policy_effective": resolved.effective,
        "decision": resolved.decision, "resource_audit": audit,
        "recipe": {"format": 1, "kind": "coldsnap-engine-graph-recipe", "engine": engine, "mode": resolved.mode,
                   "shape_calibration_policy": shape_calibration_policy or "auto", "calibration_units": units,
                   "plan_sha256": recipe_digest(engine=engine, execution=execution, requested=requested,
                                                effective=resolved.effective, audit=audit, coverage=coverage)},
    }


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _fail(rule: str) -> NoReturn:
    raise ContractError(f"graph policy record: {rule}")


def validate_graph_record(record: dict[str, Any], *, engine: str, execution: dict[str, Any],
                          coverage: dict[str, Any] | None) -> None:
    """Go `GraphPolicyRecord.Validate`: every rule, each failure naming itself."""
    if record.get("format") != 1:
        _fail("format must be 1")
    requested, effective = record.get("policy_requested"), record.get("policy_effective")
    if requested not in POLICIES or effective not in POLICIES:
        _fail("requested and effective policies must be known")
    if record.get("decision") not in DECISIONS:
        _fail("decision must be one of the four codes")
    audit = _validated_audit(record.get("resource_audit"), str(requested), str(effective))
    if record["decision"] != (expected := _expected_decision(audit, str(requested), str(effective))):
        _fail(f"decision must be {expected}")
    _validate_recipe(record.get("recipe"), audit, engine=engine, execution=execution, coverage=coverage,
                     requested=str(requested), effective=str(effective))


def _validated_audit(audit: Any, requested: str, effective: str) -> dict[str, Any]:
    """The resource audit's shape and counts, and what it allows of the policies."""
    if not isinstance(audit, dict) or set(audit) != set(_AUDIT_KEYS) or audit["format"] != 1:
        _fail("resource_audit must have format 1 and exactly its seven keys")
    if not all(_count(audit[k]) for k in ("nccl_communicators", "registered_windows", "external_semaphores",
                                          "provider_owned_allocations")):
        _fail("resource_audit counts must be non-negative integers")
    if requested != "disabled" and effective not in ("recreate-from-plan", "preserve-nccl-exec"):
        _fail("an enabled policy must resolve to recreate-from-plan or preserve-nccl-exec")
    if audit["unknown_dependencies"] and effective not in ("recreate-from-plan", "disabled"):
        _fail("unknown dependencies allow only recreate-from-plan or disabled")
    if requested == "disabled" and (effective != "disabled" or any(
            audit[k] for k in _AUDIT_KEYS if k != "format")):
        _fail("disabled requires effective disabled and an all-zero audit")
    if requested == "recreate-from-plan" and effective != "recreate-from-plan":
        _fail("recreate-from-plan must stay recreate-from-plan")
    return audit


def _expected_decision(audit: dict[str, Any], requested: str, effective: str) -> str:
    """The decision code the requested policy and the audited communicators lead to (spec 5.4)."""
    communicators = audit["nccl_communicators"]
    if requested == "preserve-exec":
        return "graph_exec_preservation_is_unqualified" if communicators == 0 else "provider_reconstructs_communicator"
    if requested != "preserve-nccl-exec":
        return "requested_policy_is_supported"
    if communicators == 0:
        if effective != "recreate-from-plan" or not audit["unknown_dependencies"]:
            _fail("preserve-nccl-exec without communicators must recreate with unknown dependencies")
        return "graph_exec_preservation_is_unqualified"
    if effective != "preserve-nccl-exec" or audit["unknown_dependencies"] or communicators != 1:
        _fail("preserve-nccl-exec with communicators must be retained, with exactly one communicator")
    return "qualified_exact_nccl_in_place"


def _validate_recipe(recipe: Any, audit: dict[str, Any], *, engine: str, execution: dict[str, Any],
                     coverage: dict[str, Any] | None, requested: str, effective: str) -> None:
    kind = "coldsnap-engine-graph-recipe"
    if not isinstance(recipe, dict) or recipe.get("format") != 1 or recipe.get("kind") != kind:
        _fail("recipe must have format 1 and kind coldsnap-engine-graph-recipe")
    if recipe.get("engine") != engine or recipe.get("shape_calibration_policy") not in SHAPE_POLICIES:
        _fail("recipe engine must match and its shape calibration policy be auto, enabled or disabled")
    units = len(coverage.get("units", [])) if coverage else 0
    if not _count(recipe.get("calibration_units")) or recipe["calibration_units"] != units:
        _fail("recipe calibration_units must equal the coverage unit count")
    if not isinstance(recipe.get("plan_sha256"), str) or not _DIGEST.match(recipe["plan_sha256"]):
        _fail("recipe plan_sha256 must be sha256:<64 hex>")
    if recipe.get("mode") != RECIPE_MODES.get(effective):
        _fail("recipe mode must match the effective policy")
    if recipe["plan_sha256"] != recipe_digest(engine=engine, execution=execution, requested=requested,
                                              effective=effective, audit=audit, coverage=coverage):
        _fail("recipe plan_sha256 does not recompute")


def validated_graph_record(images: Path) -> RestoredGraphPolicy | None:
    """The record written at capture, every rule checked and its digest recomputed: the policy it recorded, the
    decision and the plan's digest; None if there is none."""
    path = images / "graph.json"
    if not path.exists():
        return None
    from ._reports import RestoredGraphPolicy

    try:
        stored = json.loads(path.read_text())
        record, execution = stored["record"], stored["execution"]
        validate_graph_record(record, engine="coldsnap-engine", execution=execution, coverage=None)
        return RestoredGraphPolicy(effective=str(record["policy_effective"]), decision=str(record["decision"]),
                                   plan_sha256=str(record["recipe"]["plan_sha256"]))
    except (ValueError, KeyError, TypeError, AttributeError, ContractError) as exc:
        raise WorkerError(f"graph.json: {exc}") from exc
