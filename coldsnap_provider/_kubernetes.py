"""Hosts that are Kubernetes Nodes (``[[kubernetes]]``): runtime-v1 through the cluster, node-local work over SSH.

Per configured host, one :class:`~coldsnap_runtime.backend.KubernetesBackend` (its Node, the entry's
namespace and kubeconfig). What a host's request becomes:

* ``runtime`` actions (and the legacy ``oci-pull``/``oci-push``) go to that host's backend, i.e. Pods on its
  Node through the apiserver;
* node-local operations (``exec``, ``upload`` and the destination of ``workload-copy-from``) need the node
  itself, which the apiserver does not reach: they go over SSH when the host is also a ``[[remote]]``
  entry, and are otherwise refused naming the host and what is missing. A copy-from is staged in a
  private directory here and placed on the node over that connection.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import structlog

from coldsnap_runtime import RuntimeContext, dispatch
from coldsnap_runtime.backend import KubernetesBackend
from coldsnap_runtime.errors import RequestRejected
from coldsnap_runtime.schema import WorkloadCopyFrom

from ._config import KubernetesConfig
from ._envelope import Exec, OciPull, OciPush, Runtime, Upload

if TYPE_CHECKING:
    from ._exec import ExecIdentity
    from ._operations import Operation, Outcome
    from ._remote import Remotes

__all__ = ("KubernetesHosts",)

log = structlog.get_logger(__name__)


class KubernetesHosts:
    """Every host of every ``[[kubernetes]]`` entry, by ColdSnap host name; an async context manager."""

    def __init__(self, configs: list[KubernetesConfig], *, state_dir: Path, instance: str,
                 spool_dir: str | None = None) -> None:
        self._work_dir = state_dir / "kubernetes"
        self._backends = {
            host: KubernetesBackend(kubeconfig=config.kubeconfig, namespace=config.namespace, node=config.node(host),
                                    instance=instance, request_timeout_s=config.request_timeout_s,
                                    start_timeout_s=config.start_timeout_s, spool_dir=spool_dir)
            for config in configs for host in config.hosts
        }

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset(self._backends)

    def serves(self, host: str) -> bool:
        return host in self._backends

    def backend(self, host: str) -> KubernetesBackend:
        return self._backends[host]

    async def __aenter__(self) -> KubernetesHosts:
        entered: list[KubernetesBackend] = []
        try:
            for backend in self._backends.values():
                await backend.__aenter__()
                entered.append(backend)
        except BaseException:
            for backend in entered:
                await backend.aclose()
            raise
        if self._backends:
            self._work_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for backend in self._backends.values():
            await backend.aclose()

    async def run(self, request: Operation, ctx: RuntimeContext, identity: ExecIdentity,
                  remotes: Remotes | None) -> Outcome:
        """One authorized operation for a host this object serves (Operations routes them here)."""
        backend = self.backend(ctx.host)
        match request:
            case Exec() | Upload():
                if remotes is None or not remotes.serves(ctx.host):
                    raise _node_local_refused(request, ctx.host)
                return await remotes.run(request, ctx, identity)
            case Runtime(runtime=WorkloadCopyFrom() as copy):
                if remotes is None or not remotes.serves(ctx.host):
                    raise _node_local_refused(request, ctx.host)
                await self._copy_to_node(backend, copy, ctx, remotes)
                return None
            case Runtime():
                return await dispatch(backend, request.runtime, ctx)
            case OciPull() | OciPush():
                from ._operations import legacy_registry_action

                await dispatch(backend, legacy_registry_action(request), ctx)
                return None
        operation = str(type(request).__struct_config__.tag)
        raise RequestRejected(f"host-provider operation {operation!r} is not served for Kubernetes host {ctx.host!r}")

    async def _copy_to_node(self, backend: KubernetesBackend, copy: WorkloadCopyFrom, ctx: RuntimeContext,
                            remotes: Remotes) -> None:
        """Out of the container into a private staging tree here, then onto the node over its SSH connection."""
        with tempfile.TemporaryDirectory(dir=self._work_dir, prefix="copy-") as staging:
            root = os.path.basename(copy.path) or "root"
            await backend.workload_copy_from(copy.name, copy.path, os.path.join(staging, root))
            await remotes.node(ctx.host).place_local_tree(os.path.join(staging, root), root, copy.destination,
                                                          action="workload-copy-from")

    async def recover(self) -> None:
        for host, backend in self._backends.items():
            try:
                await backend.recover()
            except Exception as exc:  # one cluster down must not stop the daemon's start
                log.warning("kubernetes recovery deferred", host=host, error=str(exc))

    async def run_maintenance(self, interval_s: float = 10.0) -> None:
        """Periodic backend maintenance (deferred removals, remove_after_exit), owned by the daemon's task group."""
        await self.recover()
        while True:
            await anyio.sleep(interval_s)
            for host, backend in self._backends.items():
                try:
                    await backend.maintain()
                except Exception:
                    log.exception("kubernetes maintenance failed", host=host)


def _node_local_refused(request: Operation, host: str) -> RequestRejected:
    operation = "workload-copy-from (its destination)" if isinstance(request, Runtime) else str(
        type(request).__struct_config__.tag)
    return RequestRejected(
        f"{operation} on host {host!r} needs the node itself, which the Kubernetes API does not reach: "
        f"host {host!r} is a [[kubernetes]] Node without a [[remote]] entry (add one with the node's SSH address "
        "to serve exec, upload and copy-from destinations there)")
