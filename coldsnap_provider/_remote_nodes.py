"""Every ``[[remote]]`` entry of the configuration, by ColdSnap host name: the composition root's one handle on
the remote nodes (:mod:`._remote`), for routing, status, the metrics' link states and maintenance.

The SSH stack behind a node is imported only when an entry exists: most daemons have none, and the suite
starts a few hundred of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from coldsnap_runtime.backend import HostPolicy

from ._config import RemoteConfig
from ._exec import ExecIdentity
from ._spool import Spool

if TYPE_CHECKING:
    from ._remote import RemoteNode

__all__ = ("Remotes",)

log = structlog.get_logger(__name__)


class Remotes:
    """Every configured remote node, by ColdSnap host name; an async context manager."""

    def __init__(self, configs: list[RemoteConfig], *, state_dir: Path, identity: ExecIdentity, spool: Spool,
                 credentials_file: str | None = None, host_policy: HostPolicy | None = None) -> None:
        self._nodes: list[RemoteNode] = []
        if configs:  # the SSH stack (asyncssh, cryptography: ~0.2 s of imports) only for a daemon that uses it
            from ._remote import RemoteNode

            self._nodes = [RemoteNode(c, work_dir=state_dir / "remotes" / str(i), identity=identity, spool=spool,
                                      credentials_file=credentials_file, host_policy=host_policy)
                           for i, c in enumerate(configs)]
        self._by_host = {host: node for node in self._nodes for host in node.config.hosts}

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset(self._by_host)

    def link_states(self) -> list[tuple[str, bool]]:
        """(host, its node's SSH link is up) for every configured host: coldsnap_provider_remote_up."""
        return [(host, node.connected) for host, node in sorted(self._by_host.items())]

    def node(self, host: str) -> RemoteNode:
        return self._by_host[host]

    async def __aenter__(self) -> Remotes:
        entered: list[RemoteNode] = []
        try:
            for node in self._nodes:
                await node.__aenter__()
                entered.append(node)
        except BaseException:
            for node in entered:
                await node.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for node in self._nodes:
            await node.aclose()

    async def status(self) -> list[dict[str, Any]]:
        """One entry per remote node: reachability and round trip of a no-op command (concurrently)."""
        results: list[dict[str, Any]] = [{} for _ in self._nodes]

        async def one(index: int, node: RemoteNode) -> None:
            results[index] = await node.status()

        async with anyio.create_task_group() as tg:
            for index, node in enumerate(self._nodes):
                tg.start_soon(one, index, node)
        return results

    async def maintain(self) -> None:
        """Every node's :meth:`RemoteNode.maintain`, one failure contained per node (the daemon's loop calls it)."""
        for node in self._nodes:
            try:
                await node.maintain()
            except Exception:
                log.exception("remote maintenance failed", host=node.name)
