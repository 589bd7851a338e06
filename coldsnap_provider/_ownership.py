"""The one workload ownership rule, for both sockets and every host kind (issue 37, finding 3).

Workload names are node-global, so which manager a workload belongs to is the label its run
recorded (``io.coldsnap-provider.manager-uid``). A manager reaches the workloads its own sessions
ran; root and the daemon's uid reach every workload. Another manager's workload is answered
**exactly as an absent one**: ``not_found`` with the text ``<action>: no such workload: <name>``,
whichever socket, action or host kind asked, so the answer tells nothing about who holds a name.

The rule is applied above the host seam (``Operations``: the session socket's runtime-v1 workload
actions, and the control socket's workload verbs), never inside a host or backend, so no host kind
can skip it: a host only answers the inspect this module asks for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from coldsnap_runtime import MANAGER_UID_LABEL
from coldsnap_runtime.errors import NotFound
from coldsnap_runtime.schema import (
    RuntimeRequest,
    WorkloadCopyFrom,
    WorkloadExec,
    WorkloadInfo,
    WorkloadInspect,
    WorkloadLogs,
    WorkloadRemove,
)

from ._listener import is_admin

__all__ = ("OwnedAction", "inspect_reached", "owned_name", "reaches", "require_reach")

# Every runtime-v1 action that names an existing workload (workload-run creates one: the engine's
# name conflict answers that, docs/threat-model.md).
OwnedAction = WorkloadRemove | WorkloadInspect | WorkloadExec | WorkloadLogs | WorkloadCopyFrom


def owned_name(request: RuntimeRequest) -> str:
    """The workload a runtime-v1 request acts on ("" for the actions that name none)."""
    return request.name if isinstance(request, OwnedAction) else ""


def reaches(uid: int, info: WorkloadInfo) -> bool:
    """Whether manager `uid` reaches the workload `info` describes (its own, or any for root and the daemon)."""
    return is_admin(uid) or info.labels.get(MANAGER_UID_LABEL) == str(uid)


async def require_reach(inspect: Callable[[str], Awaitable[WorkloadInfo]], name: str, *, uid: int,
                        action: str) -> WorkloadInfo | None:
    """The workload `name` if manager `uid` reaches it; NotFound (as for an absent one) otherwise.

    Root and the daemon's uid reach every workload, so nothing is inspected for them (None): the
    session socket's workload actions pay no extra round trip to a remote node or an apiserver."""
    if is_admin(uid):
        return None
    return await inspect_reached(inspect, name, uid=uid, action=action)


async def inspect_reached(inspect: Callable[[str], Awaitable[WorkloadInfo]], name: str, *, uid: int,
                          action: str) -> WorkloadInfo:
    """The workload `name` as `inspect` (the host's own workload-inspect) sees it, if `uid` reaches it.

    An absent workload and another manager's are both answered NotFound in `action`'s words: the
    same text, whatever `inspect` said."""
    try:
        info = await inspect(name)
    except NotFound as exc:
        raise NotFound(kind="workload", ref=name, action=action) from exc
    if not reaches(uid, info):
        raise NotFound(kind="workload", ref=name, action=action)
    return info
