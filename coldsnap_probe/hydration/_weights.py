"""Weight regions, their sources and the hydration manifest (no CUDA; the digests are `_digests.py`'s).

A `WeightRegion` says where `size` bytes of an engine's weights live in its reservation and which bytes of
which source file they are; `validate_regions` is the layout rule, `check_sources` the source rule,
`plan_for` the memory contract (`_memory.py`) a release must satisfy, and `HydrationManifest` what a release
records so that restore can put the weights back (digested, every part recomputed when decoded).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._memory import (
    MemoryCheckpointPlan,
    MemoryLayoutDescriptor,
    MemoryRegion,
    ProviderCapabilities,
    require_checkpoint_plan,
)
from ..canonical import digest
from ..errors import HydrationError, MemoryCapabilityError
from ._digests import DIGEST_PREFIX, is_region_digest, region_digest

__all__ = (
    "CAPABILITIES",
    "MANIFEST_KIND",
    "PROVIDER",
    "HydrationManifest",
    "SourceIdentity",
    "WeightRegion",
    "check_sources",
    "plan_for",
    "validate_regions",
)

MANIFEST_KIND = "coldsnap-hydration-manifest"
PROVIDER = "coldsnap-vmm-weights"
REGION_POLICIES = ("preserve", "discard")
CAPABILITIES = ProviderCapabilities(
    provider=PROVIDER, tagged_regions=True, stable_virtual_addresses=True, scoped_interception=False,
    allocation_enumeration=True, external_snapshot_store=True, graph_regions=False, per_device_synchronization=True,
    exact_address_reservation=True, page_granular_mapping=True, release_backing_retain_va=True,
    checkpoint_quiescence=True)
_ACTIONS = ("release-backing", "remap-pages")


@dataclass(frozen=True, slots=True)
class WeightRegion:
    """`size` bytes at virtual `address` come from `source` at `offset`; `digest` is `region_digest` of them.

    Policy `discard` (a KV cache, scratch): released like the weights, but not kept anywhere: it comes back
    zero-filled, with no source, offset 0 and no digest. Its bytes never reach the images either way. Every
    release zeroes it, a release that a failed capture rolls back included: an engine must not keep state that
    points into it (cached prefixes) across a release.
    """

    name: str
    address: int
    size: int
    source: str
    offset: int
    digest: str
    policy: str = "preserve"

    @property
    def preserved(self) -> bool:
        return self.policy == "preserve"

    def to_json(self) -> dict[str, Any]:
        value = dataclasses.asdict(self)
        if self.preserved:  # manifests written before discard regions existed keep their digests
            del value["policy"]
        return value

    @classmethod
    def from_json(cls, value: Any) -> WeightRegion:
        try:
            region = cls(**value)
        except TypeError as exc:
            raise HydrationError(f"malformed weight region: {exc}") from exc
        region.check_types()
        return region

    def check_types(self) -> None:
        """Integers that are not booleans, strings: each field, named when it is not."""
        for name in ("address", "size", "offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise HydrationError(f"{name} must be an integer, got {type(value).__name__}", region=str(self.name))
        for name in ("name", "source", "digest", "policy"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise HydrationError(f"{name} must be a string, got {type(value).__name__}", region=str(self.name))


def validate_regions(regions: Sequence[WeightRegion], reservation_address: int,
                     reservation_size: int) -> tuple[WeightRegion, ...]:
    """Sorted by address; each named once, non-empty, inside the reservation, not overlapping another."""
    if not regions:
        raise HydrationError("no weight regions declared")
    for region in regions:
        region.check_types()
    names = collections.Counter(r.name for r in regions)  # counted once: a peer's request may list thousands
    for region in regions:
        if not region.name or any(c.isspace() for c in region.name):
            raise HydrationError(f"region name {region.name!r} must be non-empty without whitespace")
        if names[region.name] > 1:
            raise HydrationError("declared more than once", region=region.name)
        if region.size <= 0 or region.offset < 0 or region.address < 0:
            raise HydrationError(f"size must be > 0 and address, offset >= 0 (size {region.size}, "
                                 f"offset {region.offset})", region=region.name)
        if region.policy not in REGION_POLICIES:
            raise HydrationError(f"policy {region.policy!r} must be one of {', '.join(REGION_POLICIES)}",
                                 region=region.name)
        if not region.preserved:
            for field in ("source", "offset", "digest"):
                if getattr(region, field):
                    raise HydrationError(f"{field} must be empty for a discard region, got "
                                         f"{getattr(region, field)!r}", region=region.name)
        elif not region.source:
            raise HydrationError("names no source file", region=region.name)
        elif not is_region_digest(region.digest):
            raise HydrationError(f"digest must be {DIGEST_PREFIX}<64 hex digits>", region=region.name)
        end, limit = region.address + region.size, reservation_address + reservation_size
        if region.address < reservation_address or end > limit:
            raise HydrationError(f"[{region.address:#x}, {end:#x}) exceeds the reservation "
                                 f"[{reservation_address:#x}, {limit:#x})", region=region.name)
    if not any(r.preserved for r in regions):
        raise HydrationError("no weight region declared: every region is discarded")
    ordered = tuple(sorted(regions, key=lambda r: r.address))
    for before, after in itertools.pairwise(ordered):
        if before.address + before.size > after.address:
            raise HydrationError(f"overlaps region {before.name} at {after.address:#x}", region=after.name)
    return ordered


@dataclass(frozen=True, slots=True)
class SourceIdentity:
    """What a write, truncation or replacement of a source file changes."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> SourceIdentity:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise HydrationError(f"source {path} cannot be read: {exc.strerror}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise HydrationError(f"source {path} is not a regular file")
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_sources(regions: Sequence[WeightRegion], recorded: dict[str, SourceIdentity] | None = None, *,
                  content: bool = False) -> dict[str, SourceIdentity]:
    """Every source exists and holds its region; the digest is checked when `content` or the identity changed.

    Returns the sources' identities now. Raises HydrationError naming the first region at fault.
    """
    now: dict[str, SourceIdentity] = {}
    for region in (r for r in regions if r.preserved):
        try:
            identity = now[region.source] if region.source in now else SourceIdentity.of(region.source)
        except HydrationError as exc:
            raise HydrationError(str(exc), region=region.name) from exc
        now[region.source] = identity
        if identity.size < region.offset + region.size:
            raise HydrationError(f"source {region.source} is truncated: {identity.size} bytes, the region needs "
                                 f"{region.offset + region.size}", region=region.name)
        changed = recorded is not None and recorded.get(region.source) != identity
        if content or changed:
            actual = region_digest(region.source, region.offset, region.size)
            if actual != region.digest:
                raise HydrationError(f"source {region.source} does not match the digest: expected "
                                     f"{region.digest}, found {actual}", region=region.name)
    return now


def plan_for(regions: Sequence[WeightRegion], *, address: int, size: int, granularity: int, generation: str,
             owner: str = "engine") -> tuple[MemoryLayoutDescriptor, MemoryCheckpointPlan]:
    """The `weights` layout (one extent per preserved region; the `kv_cache` layout holds the discarded ones)
    and the release/remap checkpoint plan over both."""
    ordered = validate_regions(regions, address, size)

    def layout_of(region: MemoryRegion, members: list[WeightRegion]) -> MemoryLayoutDescriptor:
        return MemoryLayoutDescriptor.create(
            provider=PROVIDER, provider_abi=1, region=region, device="cuda:0", base_address=address,
            logical_bytes=sum(r.size for r in members), allocation_granularity=granularity, mapping_granularity=size,
            layout_kind="contiguous" if len(members) == 1 else "per-layer", groups=tuple(r.name for r in members),
            extent_count=len(members), extension={"reservation_bytes": size, "regions": [r.to_json() for r in members]})

    layout = layout_of(MemoryRegion("weights", "preserve"), [r for r in ordered if r.preserved])
    discarded = [r for r in ordered if not r.preserved]
    layouts = [layout, *([layout_of(MemoryRegion("kv_cache", "discard"), discarded)] if discarded else [])]

    def prepare(resolved: tuple[MemoryRegion, ...], gen: str) -> MemoryCheckpointPlan:
        return MemoryCheckpointPlan.create(
            layouts=layouts, generation=gen, owner=owner, provider=PROVIDER, provider_abi=1, actions=_ACTIONS,
            mapped_bytes_before=size, mapped_bytes_after=0, reserved_bytes_before=size, reserved_bytes_after=size,
            participants=(owner,), quiescence_evidence="cuCtxSynchronize", terminal_on_failure=False,
            abort_safe=True)

    try:
        plan = require_checkpoint_plan(CAPABILITIES, prepare, [x.region.name for x in layouts], generation)
    except MemoryCapabilityError as exc:
        raise HydrationError(f"the checkpoint plan is refused: {exc}") from exc
    return layout, plan


@dataclass(frozen=True, slots=True)
class HydrationManifest:
    """What was released, so that restore can put it back: regions, sources, layout and plan, digested."""

    generation: str
    device: int
    reservation_address: int
    reservation_size: int
    granularity: int
    regions: tuple[WeightRegion, ...]
    sources: tuple[SourceIdentity, ...]
    layout: MemoryLayoutDescriptor
    plan: MemoryCheckpointPlan
    control: str = ""
    hydrator: str = ""  # the long-lived hydrator the engine hydrates through, if any: restore stages there early
    manifest_digest: str = ""
    format: int = 1

    def _body(self) -> dict[str, Any]:
        return {"format": self.format, "kind": MANIFEST_KIND, "generation": self.generation, "device": self.device,
                "reservation_address": self.reservation_address, "reservation_size": self.reservation_size,
                "granularity": self.granularity, "regions": [r.to_json() for r in self.regions],
                "sources": [s.to_json() for s in self.sources], "layout": self.layout.to_json(),
                "plan": self.plan.to_json(), "control": self.control,
                **({"hydrator": self.hydrator} if self.hydrator else {})}

    def stage_request(self, op: str, **extra: Any) -> dict[str, Any]:
        """A hydrator request about this manifest's allocation (`stage`, `adopt`, `discard`), keyed by its digest.
        Only the preserved regions travel: the hydrator has nothing to copy for a discarded one."""
        return {"op": op, "key": self.manifest_digest, "base": self.reservation_address,
                "size": self.reservation_size, "regions": [r.to_json() for r in self.regions if r.preserved],
                **extra}

    def to_json(self) -> dict[str, Any]:
        return {**self._body(), "manifest_digest": self.manifest_digest}

    @classmethod
    def create(cls, **fields: Any) -> HydrationManifest:
        draft = cls(**fields)
        return dataclasses.replace(draft, manifest_digest=digest(draft._body()))

    @classmethod
    def from_json(cls, value: Any) -> HydrationManifest:
        """Decode and check everything: kind, digest, regions in the reservation, layout and plan recompute."""
        try:
            if value.get("kind") != MANIFEST_KIND or value.get("format") != 1:
                raise HydrationError(f"not a format-1 {MANIFEST_KIND}")
            manifest = cls(
                generation=str(value["generation"]), device=int(value["device"]),
                reservation_address=int(value["reservation_address"]),
                reservation_size=int(value["reservation_size"]), granularity=int(value["granularity"]),
                regions=tuple(WeightRegion.from_json(r) for r in value["regions"]),
                sources=tuple(SourceIdentity(**s) for s in value["sources"]),
                layout=MemoryLayoutDescriptor.from_json(value["layout"]),
                plan=MemoryCheckpointPlan.from_json(value["plan"]), control=str(value.get("control", "")),
                hydrator=str(value.get("hydrator", "")), manifest_digest=str(value["manifest_digest"]))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise HydrationError(f"malformed hydration manifest: {type(exc).__name__}: {exc}") from exc
        except MemoryCapabilityError as exc:
            raise HydrationError(f"hydration manifest: {exc}") from exc
        if manifest.manifest_digest != digest(manifest._body()):
            raise HydrationError("hydration manifest digest does not recompute")
        layout, plan = plan_for(manifest.regions, address=manifest.reservation_address,
                                size=manifest.reservation_size, granularity=manifest.granularity,
                                generation=manifest.generation, owner=manifest.plan.owner)
        if layout.layout_digest != manifest.layout.layout_digest or plan.plan_digest != manifest.plan.plan_digest:
            raise HydrationError("hydration manifest layout or plan does not match its regions")
        return manifest

    @property
    def identities(self) -> dict[str, SourceIdentity]:
        return {s.path: s for s in self.sources}
