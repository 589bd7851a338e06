"""The graph policy decision with the NCCL provider in the loop (admission spec 5.4, NCCL spec 6c).

The resolution table and the recipe modes live in `coldsnap_probe` (the one source); this adds
the rule the shim can judge: `preserve-nccl-exec` needs an admitted in-place provider, else it
falls back.
"""

from __future__ import annotations

import dataclasses

import msgspec

from coldsnap_probe import RECIPE_MODES, ContractError, ResourceAudit, resolve_graph_policy

from .errors import InvalidGraphPolicy

__all__ = ("GraphDecision", "decide_graph_policy")

_REASONS = {
    "disabled": "asynchronous graphs are disabled",
    "requested_policy_is_supported": "graphs are recreated from the captured plan",
    "graph_exec_preservation_is_unqualified": "one worker: no NCCL communicator to preserve",
    "provider_reconstructs_communicator": "the NCCL provider reconstructs communicators: executables are recreated",
    "qualified_exact_nccl_in_place": "exact in-place NCCL provider admitted with more than one worker",
}


class GraphDecision(msgspec.Struct, frozen=True, kw_only=True):
    policy_requested: str
    policy_effective: str
    decision: str
    reason: str
    resource_audit: ResourceAudit
    recipe_mode: str


def decide_graph_policy(requested: str, workers: int, *, in_place_admitted: bool,
                        in_place_reason: str = "") -> GraphDecision:
    """`preserve-nccl-exec` is effective only with more than one worker and an admitted in-place provider."""
    try:
        resolved = resolve_graph_policy(requested, workers)
    except ContractError as exc:
        raise InvalidGraphPolicy(str(exc)) from exc
    effective, decision = resolved.effective, resolved.decision
    audit = resolved.audit
    reason = _REASONS["disabled" if requested == "disabled" else decision]
    if effective == "preserve-nccl-exec" and not in_place_admitted:
        effective, decision = "recreate-from-plan", "graph_exec_preservation_is_unqualified"
        audit = dataclasses.replace(audit, unknown_dependencies=True)
        reason = f"no admitted in-place NCCL provider: {in_place_reason or 'not admitted'}"
    return GraphDecision(policy_requested=requested, policy_effective=effective, decision=decision, reason=reason,
                         resource_audit=audit, recipe_mode=RECIPE_MODES[effective])
