"""A remote node's Docker Engine, over the link's forwarded socket: the same backend, the node's paths.

Host paths in runtime actions are the remote node's: a copy-from destination is placed there over SFTP and a
build context is fetched from there (:mod:`._remote_transfer`); the pid of a cancelled exec is killed there.
Only the registry credentials this entry allows travel to the node's engine (``[[remote]] registries``).
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

import anyio
import msgspec
import structlog

from coldsnap_runtime import Owner
from coldsnap_runtime.backend import DockerBackend
from coldsnap_runtime.schema import ImageBuild

from ._remote_link import RemoteLink
from ._remote_transfer import RemoteFiles

__all__ = ("RemoteDocker",)

log = structlog.get_logger(__name__)

_KILL_BUDGET_S = 20.0


class RemoteDocker(DockerBackend):
    """The node's Docker Engine over the forwarded socket; host paths are on the remote node."""

    def __init__(self, link: RemoteLink, files: RemoteFiles, **kwargs: Any) -> None:
        super().__init__(url=f"unix://{link.docker_path}", **kwargs)
        self._link = link
        self._files = files

    async def workload_copy_from(self, name: str, path: str, destination: str, *,
                                 owner: Owner | None = None) -> None:
        """Fetch through the engine into a private local staging tree, then place it remotely over SFTP.

        On the remote node every write is the SSH user's (the identity remote exec runs as); `owner`, a local
        identity, does not apply there.
        """
        with self._files.spool.staging("copy") as staging:
            root = posixpath.basename(path) or "root"
            await super().workload_copy_from(name, path, os.path.join(staging, root))
            await self._files.place_local_tree(os.path.join(staging, root), root, destination,
                                               action="workload-copy-from")

    async def image_build(self, build: ImageBuild, *, owner: Owner | None = None,
                          remote_sources: bool = True) -> None:
        """The context directories are on the remote node: fetch them (a tar made there), then build.

        The node's tar reads as the SSH user (the identity remote exec runs as); the fetched copy is the
        daemon's own, so it is packed as the daemon: `owner`, a local identity, does not apply there.
        """
        with self._files.spool.staging("build") as staging:
            context = await self._files.fetch_tree(build.context, os.path.join(staging, "context"))
            contexts = {key: await self._files.fetch_tree(value, os.path.join(staging, f"context-{i}"))
                        for i, (key, value) in enumerate(sorted(build.contexts.items()))}
            await super().image_build(msgspec.structs.replace(build, context=context, contexts=contexts),
                                      remote_sources=remote_sources)

    async def _kill_exec(self, exec_id: str) -> None:
        """The exec's pid is in the remote node's namespace: kill it there, never a local process."""
        with anyio.move_on_after(_KILL_BUDGET_S, shield=True):
            try:
                state = await self.docker.containers.exec(exec_id).inspect()
            except Exception as exc:  # engine or link gone: the exec dies with its engine connection
                log.warning("cannot inspect the cancelled remote exec", error=str(exc))
                return
            pid = int(state.get("Pid") or 0)
            if state.get("Running") and pid > 0:
                await self._link.run_quiet(f"kill -KILL {pid}")
