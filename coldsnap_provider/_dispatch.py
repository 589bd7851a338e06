"""From a decoded request and its session to a reply: auth, capability, host, operation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from coldsnap_runtime import Backend, Owner, RuntimeContext, dispatch
from coldsnap_runtime.errors import RequestRejected, RuntimeFailed
from coldsnap_runtime.schema import ImagePull, ImagePush

from ._envelope import (
    Capabilities,
    Exec,
    HuggingfacePublish,
    HuggingfaceResolve,
    OciPull,
    OciPush,
    Reply,
    Request,
    Runtime,
    Upload,
)
from ._exec import ExecIdentity, GroupLedger, run_argv
from ._sessions import SessionRecord

if TYPE_CHECKING:
    from ._huggingface import HuggingfaceClient
    from ._remote import Remotes

__all__ = ("Operations",)


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
        # Reference order; only what is implemented and enabled.
        self.capabilities = [
            "exec",
            *(["huggingface-publish", "huggingface-resolve"] if huggingface is not None else []),
            *(["oci-pull"] if allow_pull else []),
            *(["oci-push"] if allow_push else []),
            "runtime-v1",
            "upload",
        ]

    async def handle(self, request: Request, record: SessionRecord) -> Reply:
        """Run one authenticated, capability-checked request (see ProviderHandler)."""
        if isinstance(request, Capabilities):
            return Reply(format=1, id=request.id, ok=True, provider=self.provider_name,
                         capabilities=list(self.capabilities))
        self._authorize_host(request.host, record)
        if self.remotes is not None and self.remotes.serves(request.host):
            return await self.remotes.handle(request, self._runtime_context(request.host, record), self.identity)
        match request:
            case Exec():
                result = await run_argv(request.arguments, stdin=request.input,
                                        combined=request.combined, identity=self.identity,
                                        groups=self.groups)
                return Reply(format=1, id=request.id, ok=True, exit_code=result.exit_code,
                             output=result.stdout, error_output=result.stderr)
            case Upload():
                await self._upload(request)
                return Reply(format=1, id=request.id, ok=True)
            case Runtime():
                response = await dispatch(self.backend, request.runtime,
                                          self._runtime_context(request.host, record))
                return Reply(format=1, id=request.id, ok=True, runtime=response)
            case HuggingfacePublish():
                await self._hub("huggingface-publish").publish(request)
                return Reply(format=1, id=request.id, ok=True)
            case HuggingfaceResolve():
                value = await self._hub("huggingface-resolve").resolve(request)
                return Reply(format=1, id=request.id, ok=True, value=value)
            case OciPull() | OciPush():  # legacy top-level forms of the runtime registry actions
                legacy = ImagePull(image=request.image) if isinstance(request, OciPull) else ImagePush(
                    image=request.image)
                await dispatch(self.backend, legacy, self._runtime_context(request.host, record))
                return Reply(format=1, id=request.id, ok=True)
        raise TypeError(f"unhandled request {request!r}")  # pragma: no cover - closed union

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
