"""The graph policy decision with the NCCL provider in the loop (admission spec 5.4, NCCL spec 6c).

The resolution table, the downgrade rule and the recipe modes live in `coldsnap_probe` (the one source,
`plan_graph_policy`); this gives the shim's callers the decision as one typed value.
"""

from __future__ import annotations

import msgspec

from coldsnap_probe import ContractError, GraphPlan, ResourceAudit, plan_graph_policy

from .errors import InvalidGraphPolicy

__all__ = ("GraphDecision", "decide_graph_policy")


class GraphDecision(msgspec.Struct, frozen=True, kw_only=True):
    policy_requested: str
    policy_recorded: str  # what the graph record states as requested (differs only on a downgrade)
    policy_effective: str
    decision: str
    reason: str
    resource_audit: ResourceAudit
    recipe_mode: str


def decide_graph_policy(requested: str, workers: int, *, in_place_admitted: bool,
                        in_place_reason: str = "") -> GraphDecision:
    """`preserve-nccl-exec` is effective only with more than one worker and an admitted in-place provider."""
    try:
        plan: GraphPlan = plan_graph_policy(requested, workers, in_place_admitted=in_place_admitted,
                                            in_place_reason=in_place_reason)
    except ContractError as exc:
        raise InvalidGraphPolicy(str(exc)) from exc
    resolved = plan.resolution
    return GraphDecision(policy_requested=requested, policy_recorded=plan.recorded,
                         policy_effective=resolved.effective, decision=resolved.decision, reason=plan.reason,
                         resource_audit=resolved.audit, recipe_mode=resolved.mode)
