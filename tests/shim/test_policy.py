"""The graph policy with the NCCL provider in the loop (`_policy.py`)."""

from __future__ import annotations

import pytest

from coldsnap_probe import ContractError
from nccl_shim import InvalidGraphPolicy, decide_graph_policy


@pytest.mark.parametrize(("requested", "workers", "admitted", "effective", "decision", "unknown"), [
    ("disabled", 4, True, "disabled", "requested_policy_is_supported", False),
    ("recreate-from-plan", 2, True, "recreate-from-plan", "requested_policy_is_supported", True),
    ("preserve-exec", 1, True, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True),
    ("preserve-exec", 2, True, "recreate-from-plan", "provider_reconstructs_communicator", True),
    ("preserve-nccl-exec", 1, True, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True),
    ("preserve-nccl-exec", 2, True, "preserve-nccl-exec", "qualified_exact_nccl_in_place", False),
    ("preserve-nccl-exec", 2, False, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True),
])
def test_graph_policy_table(requested: str, workers: int, admitted: bool, effective: str, decision: str,
                            unknown: bool) -> None:
    result = decide_graph_policy(requested, workers, in_place_admitted=admitted,
                                 in_place_reason="NCCL provider lacks coldsnapNcclInPlaceQuery")
    assert (result.policy_effective, result.decision) == (effective, decision)
    assert result.resource_audit.unknown_dependencies is unknown
    if requested == "preserve-nccl-exec" and workers == 2 and not admitted:
        assert "lacks coldsnapNcclInPlaceQuery" in result.reason
    assert result.recipe_mode == {"disabled": "disabled", "recreate-from-plan": "engine-native-async",
                                  "preserve-nccl-exec": "engine-native-retained"}[effective]


@pytest.mark.parametrize(("requested", "workers", "message"), [
    ("preserve-everything", 2, "graph policy must be one of"), ("disabled", 0, "workers must be >= 1")])
def test_a_policy_outside_the_table_is_refused_with_its_cause(requested: str, workers: int, message: str) -> None:
    with pytest.raises(InvalidGraphPolicy, match=message) as info:
        decide_graph_policy(requested, workers, in_place_admitted=True)
    assert isinstance(info.value.__cause__, ContractError)

