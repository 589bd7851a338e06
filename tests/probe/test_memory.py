"""Memory contracts (spec 6): layouts, residency, the fail-before-release gate, cross-rank agreement."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coldsnap_probe._memory import (
    STANDARD_REGIONS,
    MemoryCheckpointPlan,
    MemoryLayoutDescriptor,
    MemoryRegion,
    ProviderCapabilities,
    require_checkpoint_plan,
    resolve_regions,
)
from coldsnap_probe.errors import MemoryCapabilityError

REGIONS = {r.name: r for r in STANDARD_REGIONS}


def layout(region: str = "weights", **overrides: Any) -> MemoryLayoutDescriptor:
    fields: dict[str, Any] = {"provider": "vllm-cumem", "provider_abi": 1, "region": REGIONS[region],
                              "device": "cuda:0",
                              "base_address": 0x7F0000000000, "logical_bytes": 1 << 30,
                              "allocation_granularity": 2 << 20, "mapping_granularity": 2 << 20,
                              "layout_kind": "per-layer", "groups": ("layer.0", "layer.1"), "extent_count": 2,
                              "extension": {"b": 1, "a": [True]}}
    fields.update(overrides)
    return MemoryLayoutDescriptor.create(**fields)


def capabilities(**extra: bool) -> ProviderCapabilities:
    return ProviderCapabilities(provider="vllm-cumem", tagged_regions=True, stable_virtual_addresses=True,
                                scoped_interception=True, allocation_enumeration=True, external_snapshot_store=False,
                                graph_regions=True, per_device_synchronization=True, checkpoint_quiescence=True,
                                **extra)


def plan(owner: str = "rank-0", actions: tuple[str, ...] = ("retain",), participants: tuple[str, ...] = ("rank-0",),
         regions: tuple[str, ...] = ("weights", "kv_cache"), generation: str = "g1",
         **extra: Any) -> MemoryCheckpointPlan:
    return MemoryCheckpointPlan.create(
        layouts=[layout(r) for r in regions], generation=generation, owner=owner, provider="vllm-cumem",
        provider_abi=1, actions=actions, mapped_bytes_before=2 << 30, mapped_bytes_after=1 << 30,
        reserved_bytes_before=2 << 30, reserved_bytes_after=2 << 30, participants=participants,
        quiescence_evidence="stream-synchronized", terminal_on_failure=True, abort_safe=True, **extra)


def test_standard_regions_and_resolution() -> None:
    assert [r.name for r in STANDARD_REGIONS] == ["weights", "kv_cache", "cuda_graph", "workspace", "external"]
    assert [r.name for r in resolve_regions(["kv_cache", "weights"])] == ["kv_cache", "weights"]
    with pytest.raises(MemoryCapabilityError, match="unknown memory regions: nope"):
        resolve_regions(["nope"])
    with pytest.raises(MemoryCapabilityError, match="must not repeat"):
        resolve_regions(["weights", "weights"])
    with pytest.raises(MemoryCapabilityError, match="external region cannot claim stable"):
        MemoryRegion("x", "external", stable_address=True)


def test_layout_digest_is_canonical_and_rechecked() -> None:
    first = layout()
    assert first.extension_json == '{"a":[true],"b":1}' and first.layout_digest.startswith("sha256:")
    assert layout().layout_digest == first.layout_digest
    with pytest.raises(MemoryCapabilityError, match="does not recompute"):
        dataclasses.replace(first, logical_bytes=1).validate()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"base_address": None}, "claims a stable address but has no base address"),
    ({"logical_bytes": 0}, "logical_bytes is 0 exactly when extent_count is 0"),
    ({"allocation_granularity": 0}, "granularities must be > 0"),
    ({"groups": ("a", "a")}, "groups must be unique"),
    ({"provider_abi": 0}, "provider_abi must be > 0"),
    ({"layout_kind": "sparse"}, "layout_kind must be one of"),
])
def test_layout_rules(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(MemoryCapabilityError, match=message):
        layout(**overrides)


def test_gate_passes_a_retaining_plan_and_checks_it_against_the_request() -> None:
    calls: list[str] = []

    def prepare(regions: tuple[MemoryRegion, ...], generation: str) -> MemoryCheckpointPlan:
        calls.append(generation)
        return plan(regions=tuple(r.name for r in regions), generation=generation)

    accepted = require_checkpoint_plan(capabilities(), prepare, ["weights", "kv_cache"], "g1")
    assert accepted.generation == "g1" and calls == ["g1"]
    with pytest.raises(MemoryCapabilityError, match="generation 'g1' is not 'g2'"):
        require_checkpoint_plan(capabilities(), lambda r, g: plan(regions=tuple(x.name for x in r)),
                                ["weights", "kv_cache"], "g2")
    with pytest.raises(MemoryCapabilityError, match="covers different regions"):
        require_checkpoint_plan(capabilities(), lambda r, g: plan(generation=g), ["weights"], "g1")


@pytest.mark.parametrize(("action", "missing"), [
    ("release-backing", "release_backing_retain_va"), ("unmap-pages", "page_granular_mapping"),
    ("remap-pages", "page_granular_mapping"), ("replay-mapping", "mapping_recipe_replay"),
])
def test_gate_fails_before_release_when_a_capability_is_missing(action: str, missing: str) -> None:
    with pytest.raises(MemoryCapabilityError, match=f"lacks {missing}, needed for {action}"):
        require_checkpoint_plan(capabilities(), lambda r, g: plan(actions=(action,)), ["weights", "kv_cache"], "g1")


def test_gate_refuses_a_provider_without_quiescence_before_calling_it() -> None:
    called = []
    caps = dataclasses.replace(capabilities(), checkpoint_quiescence=False)
    with pytest.raises(MemoryCapabilityError, match="lacks checkpoint_quiescence"):
        require_checkpoint_plan(caps, lambda r, g: called.append(1), None, "g1")
    assert called == []


def test_distributed_mapping_changes_need_atomic_mapping() -> None:
    caps = capabilities(release_backing_retain_va=True)
    two = lambda r, g: plan(actions=("release-backing",), participants=("rank-0", "rank-1"))  # noqa: E731
    with pytest.raises(MemoryCapabilityError, match="lacks distributed_atomic_mapping"):
        require_checkpoint_plan(caps, two, ["weights", "kv_cache"], "g1")
    require_checkpoint_plan(capabilities(release_backing_retain_va=True, distributed_atomic_mapping=True), two,
                            ["weights", "kv_cache"], "g1")


@given(st.lists(st.sampled_from([r.name for r in STANDARD_REGIONS if r.stable_address]), min_size=1, max_size=4,
                unique=True),
       st.lists(st.sampled_from(["retain", "release-backing", "unmap-pages"]), min_size=1, max_size=3, unique=True),
       st.integers(min_value=1, max_value=4))
def test_plans_roundtrip_for_any_shape(regions: list[str], actions: list[str], ranks: int) -> None:
    participants = tuple(f"rank-{i}" for i in range(ranks))
    plans = [plan(owner=p, participants=participants, regions=tuple(regions), actions=tuple(actions))
             for p in participants]
    for p in plans:
        p.validate()
        assert dataclasses.replace(p).plan_digest == p.plan_digest


def test_layout_and_plan_json_round_trip_and_refuse_tampering() -> None:
    import json

    lay, pl = layout(), plan()
    assert MemoryLayoutDescriptor.from_json(json.loads(json.dumps(lay.to_json()))) == lay
    assert MemoryCheckpointPlan.from_json(json.loads(json.dumps(pl.to_json()))) == pl
    moved = {**lay.to_json(), "base_address": lay.base_address + 4096}  # type: ignore[operator]
    with pytest.raises(MemoryCapabilityError, match="layout digest does not recompute"):
        MemoryLayoutDescriptor.from_json(moved)
    with pytest.raises(MemoryCapabilityError, match="plan digest does not recompute"):
        MemoryCheckpointPlan.from_json({**pl.to_json(), "mapped_bytes_after": 0})
    with pytest.raises(MemoryCapabilityError, match="malformed checkpoint plan"):
        MemoryCheckpointPlan.from_json({**pl.to_json(), "surprise": 1})
    with pytest.raises(MemoryCapabilityError, match="malformed memory layout"):
        MemoryLayoutDescriptor.from_json({"region": {"name": "weights"}})
