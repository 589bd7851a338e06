"""Hosts beyond this node: a :class:`~._hosts.Host` for each ``[[remote]]`` entry, reached over SSH.

A remote node needs only ``sshd`` and ``dockerd``. Per entry, :class:`RemoteNode` puts together:

* its link (:mod:`._remote_link`): one kept-alive connection, plain host keys pinned in ``known_hosts``;
* exec there (:mod:`._remote_exec`), as the SSH user, killable from a second channel;
* its Docker Engine through the link (:mod:`._remote_docker`), with its own instance id and image
  ledger, the ``[gpus]``/``[runtime]`` policy applied from the node's own facts (never this node's), and
  only the registry credentials the entry allows;
* files both ways (:mod:`._remote_transfer`), spooled on disk and bounded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import asyncssh
import structlog

from coldsnap_runtime import RuntimeContext, dispatch
from coldsnap_runtime.backend import HostPolicy
from coldsnap_runtime.errors import BackendError, BackendUnavailable, RequestRejected
from coldsnap_runtime.schema import RuntimeRequest, RuntimeResponse

from ._config import RemoteConfig
from ._envelope import Exec, Upload
from ._exec import ExecIdentity, ExecResult
from ._hosts import instance_id
from ._remote_docker import RemoteDocker
from ._remote_exec import RemoteExec
from ._remote_link import RemoteLink, RemoteUnavailable
from ._remote_transfer import RemoteFiles

if TYPE_CHECKING:
    from ._huggingface import HuggingfaceClient
    from ._spool import Spool

__all__ = ("RemoteNode", "RemoteUnavailable")

log = structlog.get_logger(__name__)

_STATUS_BUDGET_S = 5.0
_RECOVER_BUDGET_S = 20.0


class RemoteNode:
    """One `[[remote]]` entry: a Host whose exec, files and runtime go over one SSH link."""

    def __init__(self, config: RemoteConfig, *, work_dir: Path, identity: ExecIdentity, spool: Spool,
                 credentials_file: str | None = None, host_policy: HostPolicy | None = None) -> None:
        self.config = config
        self.name = config.hosts[0]
        self._identity = identity  # reads the sources of an upload on this node
        self._link = RemoteLink(config, work_dir=work_dir)
        self._exec = RemoteExec(self._link)
        self._files = RemoteFiles(self._link, spool)
        # Its own instance id (RPC-owned leftovers of an earlier daemon are recovered on first connect) and
        # image ledger (image-remove touches only what this provider pulled, built or tagged there).
        self._docker = RemoteDocker(self._link, self._files, credentials_file=credentials_file,
                                    registries=frozenset(config.registries), spool_dir=spool.directory,
                                    copy_max_bytes=spool.max_bytes, image_ledger=work_dir / "images.json",
                                    instance=instance_id(work_dir), host_policy=host_policy)
        self._recovered = False

    async def __aenter__(self) -> RemoteNode:
        self._link.open()
        await self._docker.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._docker.aclose()
            await self._link.aclose()

    async def _connection(self, action: str) -> asyncssh.SSHClientConnection:
        """The live link, after leftovers are recovered and what was abandoned while it was down is ended."""
        conn = await self._link.connect(action)
        await self._catch_up()
        return conn

    async def _catch_up(self) -> None:
        if not self._recovered:
            with anyio.move_on_after(_RECOVER_BUDGET_S):
                try:
                    await self._docker.recover()
                    self._recovered = True
                except BackendError as exc:
                    log.warning("remote leftovers not recovered yet", host=self.name, error=str(exc))
        if self._exec.pending_kills:  # the link is back: first end what was abandoned while it was down
            with anyio.move_on_after(_RECOVER_BUDGET_S):
                try:
                    await self._exec.run_pending_kills()
                except RemoteUnavailable as exc:
                    log.warning("remote exec not killed yet; will retry", host=self.name, error=str(exc))

    # --- Host ----------------------------------------------------------------------------

    async def exec(self, request: Exec) -> ExecResult:
        conn = await self._connection("exec")
        return await self._exec.exec(conn, request.arguments, stdin=request.input, combined=request.combined)

    async def upload(self, request: Upload) -> None:
        await self._connection("upload")
        await self._files.upload(request.sources, request.destination, recursive=request.recursive,
                                 identity=self._identity)

    async def runtime(self, request: RuntimeRequest, ctx: RuntimeContext) -> RuntimeResponse:
        await self._connection("runtime")
        try:
            return await dispatch(self._docker, request, ctx)
        except BackendUnavailable as exc:  # the forwarded engine socket: the link or the remote dockerd
            raise RemoteUnavailable(host=self.name, action=exc.action, detail=(
                f"its Docker Engine ({self.config.docker_socket}) is unreachable: {exc.detail}")) from exc

    @property
    def connected(self) -> bool:
        """Whether the node's SSH link is up now (it opens on first use)."""
        return self._link.connected

    def hub(self, operation: str) -> HuggingfaceClient:
        raise RequestRejected(f"host-provider operation {operation!r} is not served for remote host {self.name!r}")

    async def place_local_tree(self, local: str, root: str, destination: str, *, action: str) -> None:
        """Place a private, already checked local tree at `destination` on the node (a Kubernetes host's copy-from)."""
        await self._connection(action)
        await self._files.place_local_tree(local, root, destination, action=action)

    # --- operator ------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        cfg = self.config
        entry: dict[str, Any] = {"hosts": list(cfg.hosts), "address": cfg.address, "port": cfg.port,
                                 "user": cfg.user, "reachable": False, "rtt_ms": None, "error": "",
                                 "pending_kills": self._exec.pending_kills}
        with anyio.move_on_after(min(_STATUS_BUDGET_S, cfg.connect_timeout_s * 2)) as scope:
            try:
                await self._connection("status")
                started = time.perf_counter()
                await self._link.run_quiet(":")
                entry["rtt_ms"] = round((time.perf_counter() - started) * 1000, 3)
                entry["reachable"] = True
            except RemoteUnavailable as exc:
                entry["error"] = str(exc)
        if scope.cancelled_caught:
            entry["error"] = f"remote host {self.name}: no answer within {_STATUS_BUDGET_S:g} s"
        why = await self._docker.health() if entry["reachable"] else "the SSH link is down"
        entry["docker_reachable"] = entry["reachable"] and not why
        if entry["reachable"] and why:  # the link answers, the node's engine does not: say which and why
            entry["error"] = f"remote host {self.name}: its Docker Engine ({cfg.docker_socket}) does not answer: {why}"
        return entry

    async def maintain(self) -> None:
        """Retry what waits for the link (kills of abandoned execs) and the backend's deferred removals."""
        if self._exec.pending_kills and not self._link.connected:
            try:
                await self._connection("cleanup")  # reconnecting runs the pending kills
            except RemoteUnavailable:
                return
        if self._link.connected:
            await self._docker.maintain()
