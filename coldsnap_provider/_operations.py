"""The operations: from an authenticated request and its session to an outcome (the handler replies).

Each operation goes to this node (exec as `exec.user`, runtime-v1 through the backend, the Hub
client) or, for a host served by another node, to that node over SSH (``_remote``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from coldsnap_runtime import Backend, Owner, RuntimeContext, dispatch
from coldsnap_runtime.errors import RequestRejected, RuntimeFailed
from coldsnap_runtime.schema import ImagePull, ImagePush, RuntimeResponse, WorkloadRun

from ._envelope import (
    Exec,
    HuggingfacePublish,
    HuggingfaceResolve,
    OciPull,
    OciPush,
    Runtime,
    Upload,
)
from ._exec import ExecIdentity, ExecResult, GroupLedger, run_argv
from ._sessions import SessionRecord

if TYPE_CHECKING:
    from ._capsule_reports import CapsuleReports
    from ._huggingface import HuggingfaceClient
    from ._remote import Remotes

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
        remotes: Remotes | None = None,
        reports: CapsuleReports | None = None,
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
        self.remotes = remotes  # hosts served by other nodes over SSH ([[remote]]; _remote.py)
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

    async def run(self, request: Operation, record: SessionRecord) -> Outcome:
        """Run one authenticated, capability-checked operation; the handler turns the outcome into the reply."""
        self._authorize_host(request.host, record)
        ctx = self._runtime_context(request.host, record)
        if self.remotes is not None and self.remotes.serves(request.host):
            return await self.remotes.run(request, ctx, self.identity)
        match request:
            case Exec():
                return await run_argv(request.arguments, stdin=request.input, combined=request.combined,
                                      identity=self.identity, groups=self.groups)
            case Upload():
                await self._upload(request)
            case Runtime(runtime=WorkloadRun()) if self.reports is not None:  # local units only
                ctx = msgspec.structs.replace(ctx, report_dir=self.reports.allocate())
                return await dispatch(self.backend, request.runtime, ctx)
            case Runtime():
                return await dispatch(self.backend, request.runtime, ctx)
            case HuggingfacePublish():
                await self._hub("huggingface-publish").publish(request)
            case HuggingfaceResolve():
                return await self._hub("huggingface-resolve").resolve(request)
            case OciPull() | OciPush():  # legacy top-level forms of the runtime registry actions
                await dispatch(self.backend, legacy_registry_action(request), ctx)
        return None

    def _runtime_context(self, host: str, record: SessionRecord) -> RuntimeContext:
        return RuntimeContext(host=host, allow_pull=self.allow_pull, owner=self.owner,
                              cluster_id=record.cluster_id, manager_labels=record.labels,
                              manager_uid=record.uid)

    def _hub(self, operation: str) -> HuggingfaceClient:
        if self.huggingface is None:  # the handler's capability gate stops this first
            raise RequestRejected(f"unsupported host-provider capability '{operation}'")
        return self.huggingface

    def _authorize_host(self, host: str, record: SessionRecord) -> None:
        if host not in record.hosts:
            raise RequestRejected("host-provider target is outside this request")
        if host not in self.node_names and not (self.remotes is not None and self.remotes.serves(host)):
            raise RequestRejected(
                f"host-provider target {host!r} is authorized but not served by this node "
                f"(it serves: {', '.join(sorted(self.node_names))}; see node.names)"
            )

    async def _upload(self, request: Upload) -> None:
        """Copy node-local sources to the destination with the exec identity (like `cp [-R]`)."""
        argv = ["cp", *(["-R"] if request.recursive else []), "--", *request.sources, request.destination]
        result = await run_argv(argv, identity=self.identity, groups=self.groups)
        if result.exit_code != 0:
            detail = result.stderr.decode("utf-8", "replace").strip()
            raise RuntimeFailed(action="upload", detail=f"cp exited {result.exit_code}: {detail}")
