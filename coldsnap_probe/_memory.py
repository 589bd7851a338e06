"""Memory contracts (admission spec 6): layouts, residency, capabilities, checkpoint plans, agreement.

The rule that matters most: `require_checkpoint_plan` fails *before* a provider releases
anything when the plan needs a capability the provider does not advertise.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .canonical import canonical_json, digest
from .errors import MemoryCapabilityError

__all__ = (
    "ACTIONS",
    "POLICIES",
    "STANDARD_REGIONS",
    "MemoryCheckpointPlan",
    "MemoryLayoutDescriptor",
    "MemoryRegion",
    "ProviderCapabilities",
    "layout_digest",
    "plan_digest",
    "require_checkpoint_plan",
    "resolve_regions",
)

POLICIES = ("preserve", "discard", "recreate", "external")
LAYOUT_KINDS = ("contiguous", "per-layer", "unified", "opaque")
ACTIONS = ("retain", "release-backing", "unmap-pages", "remap-pages", "replay-mapping")
TRANSPORT_ACTIONS = ("retain", "detach-registrations", "reattach-registrations")
_EXTENSION_MAX = 1 << 20


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    name: str
    policy: str
    stable_address: bool = True

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise MemoryCapabilityError(f"region name {self.name!r} must be non-empty without whitespace")
        if self.policy not in POLICIES:
            raise MemoryCapabilityError(f"region {self.name}: policy must be one of {', '.join(POLICIES)}")
        if self.policy == "external" and self.stable_address:
            raise MemoryCapabilityError(f"region {self.name}: an external region cannot claim stable addresses")


STANDARD_REGIONS: tuple[MemoryRegion, ...] = (
    MemoryRegion("weights", "preserve"), MemoryRegion("kv_cache", "discard"),
    MemoryRegion("cuda_graph", "recreate"), MemoryRegion("workspace", "recreate"),
    MemoryRegion("external", "external", stable_address=False),
)


def resolve_regions(names: Sequence[str] | None) -> tuple[MemoryRegion, ...]:
    """Standard regions by name, in the caller's order; None means all of them."""
    if names is None:
        return STANDARD_REGIONS
    by_name = {r.name: r for r in STANDARD_REGIONS}
    if len(set(names)) != len(names):
        raise MemoryCapabilityError("memory regions must not repeat")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise MemoryCapabilityError(f"unknown memory regions: {', '.join(unknown)}")
    return tuple(by_name[n] for n in names)


def _non_negative(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MemoryCapabilityError(f"{name} must be a non-negative integer")


def layout_digest(layout: MemoryLayoutDescriptor) -> str:
    return digest({"format": 1, "provider": layout.provider, "provider_abi": layout.provider_abi,
                   "region": {"name": layout.region.name, "policy": layout.region.policy,
                              "stable_address": layout.region.stable_address},
                   "device": layout.device, "base_address": layout.base_address,
                   "logical_bytes": layout.logical_bytes, "allocation_granularity": layout.allocation_granularity,
                   "mapping_granularity": layout.mapping_granularity, "layout_kind": layout.layout_kind,
                   "groups": list(layout.groups), "extent_count": layout.extent_count,
                   "transport_registration_mode": layout.transport_registration_mode,
                   "extension": json.loads(layout.extension_json)})


@dataclass(frozen=True, slots=True)
class MemoryLayoutDescriptor:
    provider: str
    provider_abi: int
    region: MemoryRegion
    device: str
    base_address: int | None
    logical_bytes: int
    allocation_granularity: int
    mapping_granularity: int
    layout_kind: str
    groups: tuple[str, ...] = ()
    extent_count: int = 0
    transport_registration_mode: str = "none"
    extension_json: str = "{}"
    layout_digest: str = ""
    format: int = 1

    @classmethod
    def create(cls, **fields: Any) -> MemoryLayoutDescriptor:
        """Canonicalise the extension, compute the digest, validate."""
        extension = fields.pop("extension", {})
        if not isinstance(extension, dict):
            raise MemoryCapabilityError("extension must be an object")
        draft = cls(**fields, extension_json=canonical_json(extension).decode())
        layout = dataclasses.replace(draft, layout_digest=layout_digest(draft))
        layout.validate()
        return layout

    def validate(self) -> None:
        if self.format != 1:
            raise MemoryCapabilityError("layout format must be 1")
        if not self.provider or not self.device:
            raise MemoryCapabilityError("layout provider and device must be non-empty")
        if self.provider_abi <= 0:
            raise MemoryCapabilityError("layout provider_abi must be > 0")
        _non_negative(logical_bytes=self.logical_bytes, extent_count=self.extent_count)
        if self.base_address is not None:
            _non_negative(base_address=self.base_address)
        if self.region.stable_address and self.logical_bytes > 0 and self.base_address is None:
            raise MemoryCapabilityError(f"region {self.region.name} claims a stable address but has no base address")
        if self.allocation_granularity <= 0 or self.mapping_granularity <= 0:
            raise MemoryCapabilityError("layout granularities must be > 0")
        if self.layout_kind not in LAYOUT_KINDS:
            raise MemoryCapabilityError(f"layout_kind must be one of {', '.join(LAYOUT_KINDS)}")
        if (self.logical_bytes == 0) != (self.extent_count == 0):
            raise MemoryCapabilityError("logical_bytes is 0 exactly when extent_count is 0")
        if not self.transport_registration_mode:
            raise MemoryCapabilityError("transport_registration_mode must be non-empty")
        if any(not g for g in self.groups) or len(set(self.groups)) != len(self.groups):
            raise MemoryCapabilityError("layout groups must be unique and non-empty")
        if len(self.extension_json.encode()) > _EXTENSION_MAX:
            raise MemoryCapabilityError("layout extension exceeds 1 MiB")
        try:
            extension = json.loads(self.extension_json)
        except ValueError as exc:
            raise MemoryCapabilityError("layout extension is not JSON") from exc
        if not isinstance(extension, dict) or canonical_json(extension).decode() != self.extension_json:
            raise MemoryCapabilityError("layout extension must be a canonically stored object")
        if self.layout_digest != layout_digest(self):
            raise MemoryCapabilityError("layout digest does not recompute")

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "provider": self.provider, "provider_abi": self.provider_abi,
                "region": {"name": self.region.name, "policy": self.region.policy,
                           "stable_address": self.region.stable_address},
                "device": self.device, "base_address": self.base_address, "logical_bytes": self.logical_bytes,
                "allocation_granularity": self.allocation_granularity,
                "mapping_granularity": self.mapping_granularity, "layout_kind": self.layout_kind,
                "groups": list(self.groups), "extent_count": self.extent_count,
                "transport_registration_mode": self.transport_registration_mode,
                "extension_json": self.extension_json, "layout_digest": self.layout_digest}

    @classmethod
    def from_json(cls, value: Any) -> MemoryLayoutDescriptor:
        """Decode and validate (the digest must recompute); any malformation is a MemoryCapabilityError."""
        try:
            fields = dict(value)
            region = MemoryRegion(**fields.pop("region"))
            layout = cls(region=region, groups=tuple(fields.pop("groups")), **fields)
        except (TypeError, ValueError, KeyError) as exc:
            raise MemoryCapabilityError(f"malformed memory layout: {exc}") from exc
        layout.validate()
        return layout


@dataclass(frozen=True, slots=True)
class ProviderCapabilities:
    provider: str
    tagged_regions: bool
    stable_virtual_addresses: bool
    scoped_interception: bool
    allocation_enumeration: bool
    external_snapshot_store: bool
    graph_regions: bool
    per_device_synchronization: bool
    provider_abi: int = 1
    native_backing_stores: frozenset[str] = frozenset()
    exact_address_reservation: bool = False
    page_granular_mapping: bool = False
    batched_mapping: bool = False
    release_backing_retain_va: bool = False
    sentinel_backing: bool = False
    distributed_atomic_mapping: bool = False
    revisioned_limits: bool = False
    mapping_recipe_replay: bool = False
    transport_registration_ownership: bool = False
    background_reserve: bool = False
    checkpoint_quiescence: bool = False

    def require(self, capability: str, operation: str) -> None:
        if not getattr(self, capability):
            raise MemoryCapabilityError(f"memory provider {self.provider} lacks {capability}, needed for {operation}")


def plan_digest(plan: MemoryCheckpointPlan) -> str:
    return digest({"format": 1, "generation": plan.generation, "owner": plan.owner, "provider": plan.provider,
                   "provider_abi": plan.provider_abi, "layout_digests": [list(p) for p in plan.layout_digests],
                   "policies": [list(p) for p in plan.policies], "actions": list(plan.actions),
                   "mapped_bytes_before": plan.mapped_bytes_before, "mapped_bytes_after": plan.mapped_bytes_after,
                   "reserved_bytes_before": plan.reserved_bytes_before,
                   "reserved_bytes_after": plan.reserved_bytes_after,
                   "transport_actions": list(plan.transport_actions), "participants": list(plan.participants),
                   "quiescence_evidence": plan.quiescence_evidence,
                   "terminal_on_failure": plan.terminal_on_failure, "abort_safe": plan.abort_safe})


@dataclass(frozen=True, slots=True)
class MemoryCheckpointPlan:
    generation: str
    owner: str
    provider: str
    provider_abi: int
    layout_digests: tuple[tuple[str, str], ...]
    policies: tuple[tuple[str, str], ...]
    actions: tuple[str, ...]
    mapped_bytes_before: int
    mapped_bytes_after: int
    reserved_bytes_before: int
    reserved_bytes_after: int
    participants: tuple[str, ...]
    quiescence_evidence: str
    terminal_on_failure: bool
    abort_safe: bool
    transport_actions: tuple[str, ...] = ()
    plan_digest: str = ""
    format: int = 1

    @classmethod
    def create(cls, *, layouts: Sequence[MemoryLayoutDescriptor], **fields: Any) -> MemoryCheckpointPlan:
        """From validated layouts sharing the plan's provider; tuples sorted, digest computed."""
        if not layouts:
            raise MemoryCapabilityError("a checkpoint plan needs layouts")
        for layout in layouts:
            layout.validate()
            if (layout.provider, layout.provider_abi) != (fields["provider"], fields["provider_abi"]):
                raise MemoryCapabilityError("every layout must share the plan's provider and provider_abi")
        draft = cls(layout_digests=tuple(sorted((lay.region.name, lay.layout_digest) for lay in layouts)),
                    policies=tuple(sorted((lay.region.name, lay.region.policy) for lay in layouts)),
                    participants=tuple(sorted(set(fields.pop("participants")))), **fields)
        plan = dataclasses.replace(draft, plan_digest=plan_digest(draft))
        plan.validate()
        return plan

    def validate(self) -> None:
        if self.format != 1:
            raise MemoryCapabilityError("plan format must be 1")
        for name in ("generation", "owner", "provider", "quiescence_evidence"):
            if not getattr(self, name):
                raise MemoryCapabilityError(f"plan {name} must be non-empty")
        if self.provider_abi <= 0:
            raise MemoryCapabilityError("plan provider_abi must be > 0")
        if not self.layout_digests or not self.actions or not self.participants:
            raise MemoryCapabilityError("plan layouts, actions and participants must be non-empty")
        if list(self.participants) != sorted(set(self.participants)) or self.owner not in self.participants:
            raise MemoryCapabilityError("plan participants must be sorted, unique and contain the owner")
        for label, pairs in (("layout_digests", self.layout_digests), ("policies", self.policies)):
            names = [n for n, _ in pairs]
            if names != sorted(set(names)):
                raise MemoryCapabilityError(f"plan {label} must be sorted with one entry per region")
        if [n for n, _ in self.layout_digests] != [n for n, _ in self.policies]:
            raise MemoryCapabilityError("plan layouts and policies must cover the same regions")
        if any(p not in POLICIES for _, p in self.policies):
            raise MemoryCapabilityError("plan policies must be known")
        if any(a not in ACTIONS for a in self.actions) or len(set(self.actions)) != len(self.actions):
            raise MemoryCapabilityError("plan actions must be known and not repeat")
        if (any(a not in TRANSPORT_ACTIONS for a in self.transport_actions)
                or len(set(self.transport_actions)) != len(self.transport_actions)):
            raise MemoryCapabilityError("plan transport actions must be known and not repeat")
        _non_negative(mapped_bytes_before=self.mapped_bytes_before, mapped_bytes_after=self.mapped_bytes_after,
                      reserved_bytes_before=self.reserved_bytes_before, reserved_bytes_after=self.reserved_bytes_after)
        if self.plan_digest != plan_digest(self):
            raise MemoryCapabilityError("plan digest does not recompute")

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "generation": self.generation, "owner": self.owner,
                "provider": self.provider, "provider_abi": self.provider_abi,
                "layout_digests": [list(p) for p in self.layout_digests],
                "policies": [list(p) for p in self.policies], "actions": list(self.actions),
                "mapped_bytes_before": self.mapped_bytes_before, "mapped_bytes_after": self.mapped_bytes_after,
                "reserved_bytes_before": self.reserved_bytes_before,
                "reserved_bytes_after": self.reserved_bytes_after,
                "transport_actions": list(self.transport_actions), "participants": list(self.participants),
                "quiescence_evidence": self.quiescence_evidence, "terminal_on_failure": self.terminal_on_failure,
                "abort_safe": self.abort_safe, "plan_digest": self.plan_digest}

    @classmethod
    def from_json(cls, value: Any) -> MemoryCheckpointPlan:
        """Decode and validate (the digest must recompute); any malformation is a MemoryCapabilityError."""
        try:
            fields = dict(value)
            for key in ("layout_digests", "policies"):
                fields[key] = tuple(tuple(p) for p in fields[key])
            for key in ("actions", "transport_actions", "participants"):
                fields[key] = tuple(fields[key])
            plan = cls(**fields)
        except (TypeError, ValueError, KeyError) as exc:
            raise MemoryCapabilityError(f"malformed checkpoint plan: {exc}") from exc
        plan.validate()
        return plan


_ACTION_NEEDS = {"release-backing": ("release_backing_retain_va",), "unmap-pages": ("page_granular_mapping",),
                 "remap-pages": ("page_granular_mapping", "exact_address_reservation"),
                 "replay-mapping": ("mapping_recipe_replay", "exact_address_reservation")}


def require_checkpoint_plan(capabilities: ProviderCapabilities,
                            prepare_checkpoint: Callable[[tuple[MemoryRegion, ...], str], Any] | None,
                            regions: Sequence[str] | None, generation: str) -> MemoryCheckpointPlan:
    """The fail-before-release gate: nothing is committed or released unless every check passes."""
    capabilities.require("checkpoint_quiescence", "a memory checkpoint")
    if not callable(prepare_checkpoint):
        raise MemoryCapabilityError(f"memory provider {capabilities.provider} cannot prepare a checkpoint")
    resolved = resolve_regions(regions)
    plan = prepare_checkpoint(resolved, generation)
    if not isinstance(plan, MemoryCheckpointPlan):
        raise MemoryCapabilityError("prepare_checkpoint did not return a MemoryCheckpointPlan")
    plan.validate()
    if (plan.provider, plan.provider_abi) != (capabilities.provider, capabilities.provider_abi):
        raise MemoryCapabilityError("the plan's provider differs from the active provider")
    if plan.generation != generation:
        raise MemoryCapabilityError(f"the plan's generation {plan.generation!r} is not {generation!r}")
    if {n for n, _ in plan.policies} != {r.name for r in resolved}:
        raise MemoryCapabilityError("the plan covers different regions than requested")
    if dict(plan.policies) != {r.name: r.policy for r in resolved}:
        raise MemoryCapabilityError("the plan's policies differ from the requested regions' policies")
    for action in plan.actions:
        for capability in _ACTION_NEEDS.get(action, ()):
            capabilities.require(capability, action)
    if any(a != "retain" for a in plan.transport_actions):
        capabilities.require("transport_registration_ownership", "transport registration actions")
    if len(plan.participants) > 1 and any(a != "retain" for a in (*plan.actions, *plan.transport_actions)):
        capabilities.require("distributed_atomic_mapping", "a mapping change across participants")
    return plan
