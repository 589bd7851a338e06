"""The graph policy with the NCCL provider in the loop (`_policy.py`)."""

from __future__ import annotations

import pytest

from coldsnap_probe import ContractError, graph_record, validate_graph_record
from nccl_shim import InvalidGraphPolicy, decide_graph_policy

EXECUTION = {n: {"workers": [{"id": f"rank-{i}", "unit": f"unit-{i}", "service": "engine", "process_slot": 0,
                              "device_slots": [i]} for i in range(n)],
                 "groups": [], "services": [], "adapter": {"schema": "tp", "digest": "", "payload": {}}}
             for n in (1, 2, 4)}


@pytest.mark.parametrize(("requested", "workers", "admitted", "effective", "decision", "unknown"), [
    ("disabled", 4, True, "disabled", "requested_policy_is_supported", False),
    ("recreate-from-plan", 2, True, "recreate-from-plan", "requested_policy_is_supported", True),
    ("preserve-exec", 1, True, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True),
    ("preserve-exec", 2, True, "recreate-from-plan", "provider_reconstructs_communicator", True),
    ("preserve-nccl-exec", 1, True, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True),
    ("preserve-nccl-exec", 2, True, "preserve-nccl-exec", "qualified_exact_nccl_in_place", False),
    ("preserve-nccl-exec", 2, False, "recreate-from-plan", "requested_policy_is_supported", True),
])
def test_graph_policy_table(requested: str, workers: int, admitted: bool, effective: str, decision: str,
                            unknown: bool) -> None:
    result = decide_graph_policy(requested, workers, in_place_admitted=admitted,
                                 in_place_reason="NCCL provider lacks coldsnapNcclInPlaceQuery")
    assert (result.policy_effective, result.decision) == (effective, decision)
    assert result.resource_audit.unknown_dependencies is unknown
    if requested == "preserve-nccl-exec" and workers == 2 and not admitted:
        assert "lacks coldsnapNcclInPlaceQuery" in result.reason
    # The record a rank writes for this decision is one the validator accepts (a downgrade included).
    record = graph_record(async_graphs=requested != "disabled", graph_policy=result.policy_recorded,
                          engine="tp2", execution=EXECUTION[workers])
    validate_graph_record(record, engine="tp2", execution=EXECUTION[workers], coverage=None)
    assert (record["policy_effective"], record["decision"]) == (effective, decision)
    assert result.recipe_mode == {"disabled": "disabled", "recreate-from-plan": "engine-native-async",
                                  "preserve-nccl-exec": "engine-native-retained"}[effective]


@pytest.mark.parametrize(("requested", "workers", "message"), [
    ("preserve-everything", 2, "graph policy must be one of"), ("disabled", 0, "workers must be >= 1")])
def test_a_policy_outside_the_table_is_refused_with_its_cause(requested: str, workers: int, message: str) -> None:
    with pytest.raises(InvalidGraphPolicy, match=message) as info:
        decide_graph_policy(requested, workers, in_place_admitted=True)
    assert isinstance(info.value.__cause__, ContractError)

