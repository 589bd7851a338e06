"""The graph policy decision (admission spec 5.4, NCCL spec 6c): what the controller may promise."""

from __future__ import annotations

import msgspec

__all__ = ("GraphDecision", "decide_graph_policy")

POLICIES = ("preserve-exec", "recreate-from-plan", "preserve-nccl-exec", "disabled")


class Audit(msgspec.Struct, frozen=True, kw_only=True):
    format: int = 1
    unknown_dependencies: bool = False
    nccl_communicators: int = 0
    registered_windows: int = 0
    device_api: bool = False
    external_semaphores: int = 0
    provider_owned_allocations: int = 0


class GraphDecision(msgspec.Struct, frozen=True, kw_only=True):
    policy_requested: str
    policy_effective: str
    decision: str
    reason: str
    resource_audit: Audit
    recipe_mode: str


def decide_graph_policy(requested: str, workers: int, *, in_place_admitted: bool,
                        in_place_reason: str = "") -> GraphDecision:
    """`preserve-nccl-exec` is effective only with more than one worker and an admitted in-place provider."""
    if requested not in POLICIES:
        raise ValueError(f"graph policy must be one of {', '.join(POLICIES)}, got {requested!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if requested == "disabled":
        return GraphDecision(policy_requested=requested, policy_effective="disabled",
                             decision="requested_policy_is_supported", reason="asynchronous graphs are disabled",
                             resource_audit=Audit(), recipe_mode="disabled")
    communicators = 1 if workers > 1 else 0
    recreate = Audit(unknown_dependencies=True, nccl_communicators=communicators)

    def fallback(decision: str, reason: str) -> GraphDecision:
        return GraphDecision(policy_requested=requested, policy_effective="recreate-from-plan", decision=decision,
                             reason=reason, resource_audit=recreate, recipe_mode="engine-native-async")

    if requested == "recreate-from-plan":
        return fallback("requested_policy_is_supported", "graphs are recreated from the captured plan")
    if workers == 1:
        return fallback("graph_exec_preservation_is_unqualified",
                        "one worker: no NCCL communicator to preserve, graph executables are recreated")
    if requested == "preserve-exec":
        return fallback("provider_reconstructs_communicator",
                        "the NCCL provider reconstructs communicators: graph executables cannot be preserved")
    if not in_place_admitted:
        return fallback("graph_exec_preservation_is_unqualified",
                        f"no admitted in-place NCCL provider: {in_place_reason or 'not admitted'}")
    return GraphDecision(policy_requested=requested, policy_effective="preserve-nccl-exec",
                         decision="qualified_exact_nccl_in_place",
                         reason="exact in-place NCCL provider admitted with more than one worker",
                         resource_audit=Audit(unknown_dependencies=False, nccl_communicators=1),
                         recipe_mode="engine-native-retained")
