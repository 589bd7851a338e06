"""From a decoded request and its session to a reply: auth, capability, host, operation."""

from __future__ import annotations

from coldsnap_runtime import Backend, RuntimeContext, dispatch
from coldsnap_runtime.errors import RequestRejected, RuntimeFailed

from ._envelope import Capabilities, Exec, Reply, Request, Runtime, Upload
from ._exec import ExecIdentity, run_argv
from ._sessions import SessionRecord

__all__ = ("Operations",)

_UNAUTHORIZED = "host-provider session is unauthorized"


class Operations:
    """The operations one daemon offers; stateless apart from its collaborators."""

    def __init__(
        self,
        *,
        provider_name: str,
        backend: Backend,
        node_names: frozenset[str],
        identity: ExecIdentity,
        allow_pull: bool,
        allow_push: bool,
    ) -> None:
        self.provider_name = provider_name
        self.backend = backend
        self.node_names = node_names
        self.identity = identity
        self.allow_pull = allow_pull
        self.allow_push = allow_push
        # Reference order; only what is implemented and enabled.
        self.capabilities = [
            "exec",
            *(["oci-pull"] if allow_pull else []),
            *(["oci-push"] if allow_push else []),
            "runtime-v1",
            "upload",
        ]

    async def handle(self, request: Request, record: SessionRecord) -> Reply:
        if not record.token_matches(request.token, request.session):
            raise RequestRejected(_UNAUTHORIZED)
        if isinstance(request, Capabilities):
            return Reply(format=1, id=request.id, ok=True, provider=self.provider_name,
                         capabilities=list(self.capabilities))
        self._authorize_host(request.host, record)
        match request:
            case Exec():
                result = await run_argv(request.arguments, stdin=request.input,
                                        combined=request.combined, identity=self.identity)
                return Reply(format=1, id=request.id, ok=True, exit_code=result.exit_code,
                             output=result.stdout, error_output=result.stderr)
            case Upload():
                await self._upload(request)
                return Reply(format=1, id=request.id, ok=True)
            case Runtime():
                ctx = RuntimeContext(host=request.host, allow_pull=self.allow_pull,
                                     allow_push=self.allow_push, cluster_id=record.cluster_id,
                                     manager_labels=record.labels)
                response = await dispatch(self.backend, request.runtime, ctx)
                return Reply(format=1, id=request.id, ok=True, runtime=response)
        raise TypeError(f"unhandled request {request!r}")  # pragma: no cover - closed union

    def _authorize_host(self, host: str, record: SessionRecord) -> None:
        if host not in record.hosts:
            raise RequestRejected("host-provider target is outside this request")
        if host not in self.node_names:
            raise RequestRejected(
                f"host-provider target {host!r} is authorized but not served by this node "
                f"(it serves: {', '.join(sorted(self.node_names))}; see node.names)"
            )

    async def _upload(self, request: Upload) -> None:
        """Copy node-local sources to the destination with the exec identity (like `cp [-R]`)."""
        argv = ["cp", *(["-R"] if request.recursive else []), "--", *request.sources, request.destination]
        result = await run_argv(argv, identity=self.identity)
        if result.exit_code != 0:
            detail = result.stderr.decode("utf-8", "replace").strip()
            raise RuntimeFailed(action="upload", detail=f"cp exited {result.exit_code}: {detail}")
