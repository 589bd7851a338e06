"""The host seam: the node an operation runs on, whatever kind of node it is.

:class:`Host` is what the operations see. Node-local work (exec, upload, the destinations of
workload-copy-from) goes to the node; workloads and images go to the node's runtime backend.
Implementations:

* :class:`LocalHost`: this node (exec as `exec.user`, the local Docker Engine, the Hub client);
* ``RemoteNode`` (``_remote.py``): a node reached over SSH, with its own Docker Engine;
* ``KubernetesNode`` (``_kubernetes.py``): a Node of a ``[[kubernetes]]`` cluster, its workloads Pods through the
  apiserver (``KubernetesBackend``), its node-local work through the same node's ``[[remote]]`` entry, if any.

A new host kind is one more class with these four methods (docs/architecture.md, "Adding a host kind").

Dependencies run one way: operations -> hosts -> runtime backends. A host never imports the
operations.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from coldsnap_runtime import Backend, RuntimeContext, dispatch
from coldsnap_runtime.errors import CommandFailed, RequestRejected
from coldsnap_runtime.schema import RuntimeRequest, RuntimeResponse

from ._envelope import Exec, Upload
from ._exec import ExecIdentity, ExecResult, GroupLedger, run_argv

if TYPE_CHECKING:
    from ._huggingface import HuggingfaceClient

__all__ = ("Host", "LocalHost", "instance_id")


def instance_id(path: Path) -> str:
    """Names one backend's RPC-owned containers: stable across restarts, distinct per directory."""
    return hashlib.sha256(os.fsencode(path.absolute())).hexdigest()[:16]


class Host(Protocol):
    """One node: where an authorized operation for one of its ColdSnap host names runs."""

    async def exec(self, request: Exec) -> ExecResult:
        """Run exactly the request's argv on the node; the exit code as a shell reports it."""
        ...

    async def upload(self, request: Upload) -> None:
        """`cp [-R] SOURCES DESTINATION`, sources on this node, the destination on the host's node."""
        ...

    async def runtime(self, request: RuntimeRequest, ctx: RuntimeContext) -> RuntimeResponse:
        """One runtime-v1 action on the node's runtime (copy-from destinations on the node)."""
        ...

    def hub(self, operation: str) -> HuggingfaceClient:
        """The Hub client whose files are on this node, or RequestRejected naming `operation`."""
        ...


class LocalHost:
    """This node: exec and upload as `exec.user`, runtime-v1 through the local backend."""

    def __init__(self, *, backend: Backend, identity: ExecIdentity, groups: GroupLedger | None = None,
                 huggingface: HuggingfaceClient | None = None) -> None:
        self.backend = backend
        self.identity = identity
        self.groups = groups
        self.huggingface = huggingface

    async def exec(self, request: Exec) -> ExecResult:
        return await run_argv(request.arguments, stdin=request.input, combined=request.combined,
                              identity=self.identity, groups=self.groups)

    async def upload(self, request: Upload) -> None:
        """Copy node-local sources to the destination with the exec identity (like `cp [-R]`)."""
        argv = ["cp", *(["-R"] if request.recursive else []), "--", *request.sources, request.destination]
        result = await run_argv(argv, identity=self.identity, groups=self.groups)
        if result.exit_code != 0:
            detail = result.stderr.decode("utf-8", "replace").strip()
            raise CommandFailed(action="upload", status=f"cp exited {result.exit_code}", output=detail)

    async def runtime(self, request: RuntimeRequest, ctx: RuntimeContext) -> RuntimeResponse:
        return await dispatch(self.backend, request, ctx)

    def hub(self, operation: str) -> HuggingfaceClient:
        if self.huggingface is None:  # the handler's capability gate stops this first
            raise RequestRejected(f"unsupported host-provider capability '{operation}'")
        return self.huggingface
