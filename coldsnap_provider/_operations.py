"""The operations: from an authenticated request and its session to an outcome (the handler replies).

Every operation is routed once, in :meth:`Operations.run`: the session's host is checked and resolved
to the :class:`~._hosts.Host` that serves it (this node, or a node reached over SSH), and the host runs
it. This module knows no host kind's details; the hosts know nothing of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import msgspec

from coldsnap_runtime import Backend, Owner, RuntimeContext
from coldsnap_runtime.errors import NotFound, RequestRejected
from coldsnap_runtime.schema import (
    ImagePull,
    ImagePush,
    RuntimeRequest,
    RuntimeResponse,
    WorkloadInfo,
    WorkloadInspect,
    WorkloadRemove,
    WorkloadRun,
)

from ._envelope import (
    Exec,
    HuggingfacePublish,
    HuggingfaceResolve,
    OciPull,
    OciPush,
    Runtime,
    Upload,
)
from ._exec import ExecIdentity, ExecResult, GroupLedger
from ._hosts import Host, LocalHost
from ._listener import is_admin
from ._ownership import inspect_reached, owned_name, require_reach
from ._policy import Decision, Policy
from ._sessions import SessionRecord

if TYPE_CHECKING:
    from ._capsule_reports import CapsuleReports
    from ._hub_owners import HubOwners
    from ._huggingface import HuggingfaceClient
    from ._kubernetes import KubernetesHosts
    from ._remote_nodes import Remotes
__all__ = ("Operation", "Operations", "Outcome", "legacy_registry_action")

# Every request but `capabilities`, which the handler answers itself.
Operation = Exec | Upload | Runtime | HuggingfacePublish | HuggingfaceResolve | OciPull | OciPush
# What an operation produces: exec's result, a runtime response, a resolved revision, or nothing.
Outcome = ExecResult | RuntimeResponse | str | None


def legacy_registry_action(request: OciPull | OciPush) -> ImagePull | ImagePush:
    """The runtime action a legacy top-level `oci-pull`/`oci-push` stands for (spec 3.6)."""
    return ImagePull(image=request.image) if isinstance(request, OciPull) else ImagePush(image=request.image)


class Operations:
    """The operations one daemon offers; stateless apart from its collaborators."""

    def __init__(
        self,
        *,
        provider_name: str,
        backend: Backend,
        node_names: frozenset[str],
        identity: ExecIdentity,
        groups: GroupLedger | None = None,
        allow_pull: bool,
        allow_push: bool,
        huggingface: HuggingfaceClient | None = None,
        hub_owners: HubOwners,
        remotes: Remotes | None = None,
        policy: Policy,
        reports: CapsuleReports | None = None,
        kubernetes: KubernetesHosts | None = None,
    ) -> None:
        self.provider_name = provider_name
        self.backend = backend
        self.node_names = node_names
        self.identity = identity
        # Files the backend writes on this host (workload-copy-from) belong to the exec identity.
        self.owner = (Owner(uid=identity.uid, gid=identity.uid if identity.gid is None else identity.gid)
                      if identity.uid is not None else None)
        self.groups = groups
        self.allow_pull = allow_pull
        self.allow_push = allow_push
        self.huggingface = huggingface
        self.hub_owners = hub_owners  # who owns each Hub repository this provider published to (_hub_owners.py)
        self.remotes = remotes  # hosts served by other nodes over SSH ([[remote]]; _remote.py)
        self.kubernetes = kubernetes  # hosts that are Kubernetes Nodes ([[kubernetes]]; _kubernetes.py)
        local = LocalHost(backend=backend, identity=identity, groups=groups, huggingface=huggingface)
        # Every host name this daemon serves -> the node that serves it (config forbids overlaps).
        self._hosts: dict[str, Host] = {name: local for name in node_names}
        if remotes is not None:
            self._hosts.update({name: remotes.node(name) for name in remotes.hosts})
        if kubernetes is not None:  # a Kubernetes host that is also a [[remote]] uses it as its node agent
            self._hosts.update({name: kubernetes.node(name) for name in kubernetes.hosts})
        self.policy = policy  # the runtime admission policy ([policy]; _policy.py)
        self.reports = reports  # report directories for local units ([metrics]; _capsule_reports.py)
        # Reference order; only what is implemented and enabled.
        self.capabilities = [
            "exec",
            *(["huggingface-publish", "huggingface-resolve"] if huggingface is not None else []),
            *(["oci-pull"] if allow_pull else []),
            *(["oci-push"] if allow_push else []),
            "runtime-v1",
            "upload",
        ]

    def admit(self, request: Operation, record: SessionRecord) -> Decision | None:
        """The one admission point, above the host routing (every host kind sees admitted requests only):
        the decision for a runtime or Hub request (PolicyRefused carries a refusal's), None for the others.

        An admitted publish reserves its repository for the manager here, with no await between the owner
        check and the reservation (two first publishes cannot both pass); `run` settles it."""
        self._route(request.host, record)
        local = request.host in self.node_names
        if not isinstance(request, HuggingfacePublish):
            return self.policy.admit_operation(request, record, local=local)
        owners, repository = self.hub_owners, request.repository
        decision = self.policy.admit_operation(request, record, local=local, hub_owner=owners.owner(repository))
        owners.reserve(repository, record.uid)  # `run` settles it (it awaits nothing before its `try`)
        return decision

    async def run(self, request: Operation, record: SessionRecord, decision: Decision | None) -> Outcome:
        """Run one authenticated, capability-checked, admitted operation; the handler turns the outcome
        into the reply."""
        host = self._route(request.host, record)
        ctx = self._runtime_context(request.host, record, decision.capabilities if decision else None)
        if isinstance(request, Runtime) and not await self._require_owner(host, request.runtime, record, ctx):
            return RuntimeResponse()  # another manager's workload-remove: absent to this one, so success
        match request:
            case Exec():
                return await host.exec(request)
            case Upload():
                await host.upload(request)
            case Runtime(runtime=WorkloadRun()) if self.reports is not None and isinstance(host, LocalHost):
                ctx = msgspec.structs.replace(ctx, report_dir=self.reports.allocate())  # local units only
                return await host.runtime(request.runtime, ctx)
            case Runtime():
                return await host.runtime(request.runtime, ctx)
            case HuggingfacePublish():
                await self._publish(host, request)
            case HuggingfaceResolve():
                return await host.hub("huggingface-resolve").resolve(request)
            case OciPull() | OciPush():  # legacy top-level forms of the runtime registry actions
                await host.runtime(legacy_registry_action(request), ctx)
        return None

    async def managed_workload(self, host: str, name: str, *, uid: int, action: str) -> tuple[Backend, WorkloadInfo]:
        """A control-socket workload verb's workload and runtime, under the one ownership rule (_ownership.py):
        another manager's workload is NotFound, in the same words as an absent one."""
        backend = self.workload_backend(host)

        async def inspect(workload: str) -> WorkloadInfo:
            return await backend.workload_inspect(workload, include_start_time=True)

        return backend, await inspect_reached(inspect, name, uid=uid, action=action)

    def workload_backend(self, host: str) -> Backend:
        """The runtime the control socket's workload verbs use: "" = this node's engine, or a Kubernetes host's."""
        if not host or host in self.node_names:
            return self.backend
        if self.kubernetes is not None and host in self.kubernetes.hosts:
            return self.kubernetes.node(host).backend
        raise RequestRejected(f"host {host!r} is neither this node nor a Kubernetes host it serves ([[kubernetes]]); "
                              "the control socket's workload verbs reach only those")

    async def _publish(self, host: Host, request: HuggingfacePublish) -> None:
        """A publish whose repository admission reserved: the owner is on disk before a byte goes up, and a
        reservation that no publish succeeded on is given back (_hub_owners.py)."""
        owners = self.hub_owners
        published = False
        try:
            client = host.hub("huggingface-publish")  # a host without the Hub refuses: the reservation goes back
            await owners.persist("huggingface-publish")
            await client.publish(request)
            published = True
        finally:
            with anyio.CancelScope(shield=True):
                await owners.settle(request.repository, published=published, action="huggingface-publish")

    async def _require_owner(self, host: Host, request: RuntimeRequest, record: SessionRecord,
                             ctx: RuntimeContext) -> bool:
        """The ownership rule for a runtime-v1 workload action, here above the host seam so that no host kind
        skips it (issue 37, finding 3); False: a workload-remove with nothing of this manager's to remove."""
        if not (name := owned_name(request)):
            return True

        async def inspect(workload: str) -> WorkloadInfo:  # the host's own inspect, as the action will see it
            info = (await host.runtime(WorkloadInspect(name=workload), ctx)).workload
            if isinstance(info, WorkloadInfo):
                return info
            raise NotFound(kind="workload", ref=workload, action="workload-inspect")  # pragma: no cover

        try:
            await require_reach(inspect, name, uid=record.uid, action=str(request.__struct_config__.tag))
        except NotFound:
            if isinstance(request, WorkloadRemove):
                return False  # removing an absent workload is success in the protocol
            raise
        return True

    def _route(self, host: str, record: SessionRecord) -> Host:
        """Where a request enters host routing: the node serving `host`, if the session may reach it."""
        if host not in record.hosts:
            raise RequestRejected("host-provider target is outside this request")
        try:
            return self._hosts[host]
        except KeyError:
            raise RequestRejected(
                f"host-provider target {host!r} is authorized but not served by this node "
                f"(it serves: {', '.join(sorted(self.node_names))}; see node.names)"
            ) from None

    def _runtime_context(self, host: str, record: SessionRecord,
                         capabilities: tuple[str, ...] | None) -> RuntimeContext:
        return RuntimeContext(host=host, allow_pull=self.allow_pull, owner=self.owner,
                              cluster_id=record.cluster_id, manager_labels=record.labels,
                              manager_uid=record.uid, reaches_all=is_admin(record.uid), capabilities=capabilities,
                              remote_build_sources=self.policy.build_remote_sources(record.uid, record.gid))
