"""Hosts that are Kubernetes Nodes (``[[kubernetes]]``): runtime-v1 through the cluster, node-local work over SSH.

Per configured host, one :class:`KubernetesNode`: a host whose workloads are Pods on its Node (a
:class:`~coldsnap_runtime.backend.KubernetesBackend`: the entry's kubeconfig, namespace and Node name).
The apiserver does not reach the node itself, so the node-local operations (``exec``, ``upload`` and the
destination of ``workload-copy-from``) go to a :class:`NodeAgent`, the same node's ``[[remote]]`` SSH
connection, when the host has one; without it they are refused naming the host and what is missing. A
copy-from is extracted into a private staging directory here, under the Docker backend's member rules,
and placed on the node by the agent.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import structlog

from coldsnap_runtime import RuntimeContext, dispatch
from coldsnap_runtime.errors import BackendError, RequestRejected
from coldsnap_runtime.schema import RuntimeRequest, RuntimeResponse, WorkloadCopyFrom

from ._config import KubernetesConfig
from ._envelope import Exec, Upload
from ._errors import ConfigError

if TYPE_CHECKING:
    from coldsnap_runtime.backend import KubernetesBackend

    from ._exec import ExecResult
    from ._huggingface import HuggingfaceClient

__all__ = ("KubernetesHosts", "KubernetesNode", "NodeAgent")

log = structlog.get_logger(__name__)


class NodeAgent(Protocol):
    """What reaches a Kubernetes node itself (its ``[[remote]]`` SSH connection)."""

    async def exec(self, request: Exec) -> ExecResult: ...
    async def upload(self, request: Upload) -> None: ...
    async def place_local_tree(self, local: str, root: str, destination: str, *, action: str) -> None:
        """Send a private local tree (already checked) to `destination` on the node."""
        ...


class KubernetesNode:
    """One ColdSnap host that is a Kubernetes Node: workloads through the cluster, node-local work through `agent`."""

    def __init__(self, name: str, backend: KubernetesBackend, *, work_dir: Path, agent: NodeAgent | None) -> None:
        self.name = name
        self.backend = backend
        self._work_dir = work_dir
        self._agent = agent
        self.recovered = False  # recover() ran once (KubernetesHosts.maintain)

    @property
    def has_agent(self) -> bool:
        return self._agent is not None

    def _node_agent(self, operation: str) -> NodeAgent:
        if self._agent is None:
            raise RequestRejected(
                f"{operation} on host {self.name!r} needs the node itself, which the Kubernetes API does not reach: "
                f"host {self.name!r} is a [[kubernetes]] Node without a [[remote]] entry (add one with the node's "
                "SSH address to serve exec, upload and copy-from destinations there)")
        return self._agent

    async def exec(self, request: Exec) -> ExecResult:
        return await self._node_agent("exec").exec(request)

    async def upload(self, request: Upload) -> None:
        await self._node_agent("upload").upload(request)

    async def runtime(self, request: RuntimeRequest, ctx: RuntimeContext) -> RuntimeResponse:
        if isinstance(request, WorkloadCopyFrom):
            agent = self._node_agent("workload-copy-from (its destination)")
            await self._copy_to_node(request, agent, ctx)
            return RuntimeResponse()
        return await dispatch(self.backend, request, ctx)

    def hub(self, operation: str) -> HuggingfaceClient:
        raise RequestRejected(f"host-provider operation {operation!r} is not served for Kubernetes host {self.name!r}")

    async def _copy_to_node(self, copy: WorkloadCopyFrom, agent: NodeAgent, ctx: RuntimeContext) -> None:
        """Out of the container into a private staging tree here (as the daemon), then onto the node by the agent."""
        with tempfile.TemporaryDirectory(dir=self._work_dir, prefix="copy-") as staging:
            root = os.path.basename(copy.path) or "root"
            await self.backend.workload_copy_from(copy.name, copy.path, os.path.join(staging, root))
            await agent.place_local_tree(os.path.join(staging, root), root, copy.destination,
                                         action="workload-copy-from")


class KubernetesHosts:
    """Every host of every ``[[kubernetes]]`` entry, by ColdSnap host name; an async context manager.

    `agents` maps a host that is also a ``[[remote]]`` entry to that connection.
    """

    def __init__(self, configs: list[KubernetesConfig], *, state_dir: Path, instance: str,
                 agents: dict[str, NodeAgent] | None = None, spool_dir: str | None = None,
                 copy_max_bytes: int | None = None) -> None:
        self._work_dir = state_dir / "kubernetes"
        self._nodes = {}
        if configs:  # the client and aiohttp load only for a daemon that has Kubernetes hosts
            from coldsnap_runtime.backend import KubernetesBackend
        for config in configs:
            for host in config.hosts:
                backend = KubernetesBackend(
                    kubeconfig=config.kubeconfig, namespace=config.namespace, node=config.node(host),
                    instance=instance, request_timeout_s=config.request_timeout_s,
                    start_timeout_s=config.start_timeout_s, spool_dir=spool_dir, copy_max_bytes=copy_max_bytes)
                self._nodes[host] = KubernetesNode(host, backend, work_dir=self._work_dir,
                                                   agent=(agents or {}).get(host))

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset(self._nodes)

    def node(self, host: str) -> KubernetesNode:
        return self._nodes[host]

    async def __aenter__(self) -> KubernetesHosts:
        entered: list[KubernetesBackend] = []
        try:
            for name, node in self._nodes.items():
                try:
                    await node.backend.__aenter__()
                except BackendError as exc:  # an unusable kubeconfig: the daemon does not start
                    raise ConfigError(f"kubernetes host {name!r}: {exc}") from exc
                entered.append(node.backend)
        except BaseException:
            for backend in entered:
                await backend.aclose()
            raise
        if self._nodes:
            self._work_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for node in self._nodes.values():
            await node.backend.aclose()

    def status(self, reachable: Mapping[str, bool]) -> list[dict[str, object]]:
        """One entry per host: its Node and whether the apiserver answered the probe (`reachable`, _health.py)."""
        return [{"host": name, "node": node.backend.node_name, "namespace": node.backend.namespace,
                 "apiserver_reachable": reachable.get(name, False), "node_agent": node.has_agent}
                for name, node in sorted(self._nodes.items())]

    async def maintain(self) -> None:
        """Called by the daemon's maintenance loop: each host's recovery until it succeeded once (leftovers of an
        earlier process), then its deferred removals and remove_after_exit; one host's failure stays its own."""
        for name, node in self._nodes.items():
            try:
                if not node.recovered:
                    await node.backend.recover()
                    node.recovered = True
                await node.backend.maintain()
            except Exception as exc:  # one cluster down must not stop the others or the daemon
                log.warning("kubernetes maintenance deferred", host=name, error=str(exc))
