"""Graph policy records (spec 5.4-5.5): the resolution table, validation and the recipe digest."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coldsnap_probe._graph import (
    POLICIES,
    graph_record,
    recipe_digest,
    resolve_graph_policy,
    validate_graph_record,
)
from coldsnap_probe.errors import ContractError


def execution(workers: int) -> dict[str, Any]:
    return {"workers": [{"id": f"w{i}", "unit": f"unit-{i}", "service": "engine", "process_slot": 0,
                         "device_slots": [0]} for i in range(workers)],
            "groups": [],
            "services": [{"id": "engine", "role": "serving", "workers": [f"w{i}" for i in range(workers)]}],
            "adapter": {"schema": "vllm", "digest": "sha256:" + "0" * 64, "payload": {"runtime": "vllm-direct"}}}


COVERAGE = {"policy": "auto", "units": [{"unit": "unit-0", "engine": "vllm", "planned_shapes": 4,
                                         "warmed_shapes": 4, "seconds": 2.0, "evidence": {}}]}


@pytest.mark.parametrize(("requested", "workers", "effective", "decision", "unknown", "mode"), [
    ("disabled", 2, "disabled", "requested_policy_is_supported", False, "disabled"),
    ("recreate-from-plan", 1, "recreate-from-plan", "requested_policy_is_supported", True, "engine-native-async"),
    ("preserve-exec", 1, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True, "engine-native-async"),
    ("preserve-exec", 2, "recreate-from-plan", "provider_reconstructs_communicator", True, "engine-native-async"),
    ("preserve-nccl-exec", 1, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True,
     "engine-native-async"),
    ("preserve-nccl-exec", 2, "preserve-nccl-exec", "qualified_exact_nccl_in_place", False, "engine-native-retained"),
])
def test_resolution_table(requested: str, workers: int, effective: str, decision: str, unknown: bool,
                          mode: str) -> None:
    record = graph_record(async_graphs=True, graph_policy=requested, engine="vllm", execution=execution(workers))
    assert (record["policy_effective"], record["decision"]) == (effective, decision)
    assert record["resource_audit"]["unknown_dependencies"] is unknown and record["recipe"]["mode"] == mode
    validate_graph_record(record, engine="vllm", execution=execution(workers), coverage=None)


def test_async_graphs_off_means_disabled_and_empty_policy_means_recreate() -> None:
    off = graph_record(async_graphs=False, graph_policy="preserve-nccl-exec", engine="vllm", execution=execution(2))
    assert off["policy_requested"] == "disabled" and off["resource_audit"]["nccl_communicators"] == 0
    empty = graph_record(async_graphs=True, graph_policy="", engine="vllm", execution=execution(2))
    assert empty["policy_requested"] == "recreate-from-plan" and empty["resource_audit"]["nccl_communicators"] == 1


def test_recipe_digest_uses_go_float_rules_and_coverage() -> None:
    record = graph_record(async_graphs=True, graph_policy="preserve-nccl-exec", engine="vllm", execution=execution(2),
                          coverage=COVERAGE)
    assert record["recipe"]["calibration_units"] == 1
    with_int = recipe_digest(engine="vllm", execution=execution(2), requested="preserve-nccl-exec",
                             effective="preserve-nccl-exec", audit=record["resource_audit"],
                             coverage={**COVERAGE, "units": [{**COVERAGE["units"][0], "seconds": 2}]})
    assert record["recipe"]["plan_sha256"] == with_int  # 2.0 is written as Go writes it: 2
    validate_graph_record(record, engine="vllm", execution=execution(2), coverage=COVERAGE)


@pytest.mark.parametrize(("mutate", "rule"), [
    (lambda r: r.update(format=2), "format must be 1"),
    (lambda r: r.update(decision="maybe"), "decision must be one of"),
    (lambda r: r.update(policy_effective="preserve-exec"), "must resolve to recreate-from-plan or preserve-nccl-exec"),
    (lambda r: r["resource_audit"].update(nccl_communicators=-1), "counts must be non-negative"),
    (lambda r: r["resource_audit"].update(unknown_dependencies=True), "unknown dependencies allow only"),
    (lambda r: r["resource_audit"].update(nccl_communicators=2), "exactly one communicator"),
    (lambda r: r["recipe"].update(mode="engine-native-async"), "recipe mode must match"),
    (lambda r: r["recipe"].update(calibration_units=3), "calibration_units must equal"),
    (lambda r: r["recipe"].update(shape_calibration_policy="sometimes"), "shape calibration policy"),
    (lambda r: r["recipe"].update(plan_sha256="sha256:" + "f" * 64), "does not recompute"),
    (lambda r: r["recipe"].update(plan_sha256="md5:x"), "plan_sha256 must be sha256"),
])
def test_validation_names_the_broken_rule(mutate: Any, rule: str) -> None:
    record = copy.deepcopy(graph_record(async_graphs=True, graph_policy="preserve-nccl-exec", engine="vllm",
                                        execution=execution(2)))
    mutate(record)
    with pytest.raises(ContractError, match=rule):
        validate_graph_record(record, engine="vllm", execution=execution(2), coverage=None)


@given(requested=st.sampled_from(POLICIES), workers=st.integers(min_value=1, max_value=64),
       async_graphs=st.booleans(), engine=st.sampled_from(["vllm", "sglang"]))
def test_every_resolved_record_validates(requested: str, workers: int, async_graphs: bool, engine: str) -> None:
    record = graph_record(async_graphs=async_graphs, graph_policy=requested, engine=engine,
                          execution=execution(workers))
    validate_graph_record(record, engine=engine, execution=execution(workers), coverage=None)
    resolved = resolve_graph_policy(record["policy_requested"], workers)
    assert resolved.effective == record["policy_effective"] and resolved.mode == record["recipe"]["mode"]
    assert resolved.audit.to_json() == record["resource_audit"]
    retained = resolved.effective == "preserve-nccl-exec"
    assert not retained or (workers > 1 and requested == "preserve-nccl-exec" and async_graphs)
