"""Which paths of a capsule's image still hold the daemon's stub, so that workload-run binds the capture's files
only there (``_captures.py``).

The files label says where the capture's files land, as the capture's build placed them. A later layer may have
put other bytes at such a path or removed it: a ``COPY`` after the capture's, or an image built ``FROM`` the
capsule (the labels are inherited). The image, run without the store, shows that layer's file; a read-only bind of
the capture's file would hide it (review of issue 34, finding 14). So a capture's file is bound only where the
image still holds the stub byte for byte, and the container sees what the image holds everywhere else: the store
stays an optimisation, never a different image.

The image is read through a container created from it and never started (the engine's archive API; the path's
stat first, so a large file put there is never read), removed at once; it carries the RPC ownership labels, so a
daemon that dies meanwhile removes it at its next start. An image is immutable: its answer is kept by image id, and
is read when the daemon builds or pulls the image, so that its first run does not wait for it.
"""

from __future__ import annotations

import io
import tarfile
from typing import Any
from urllib.parse import quote

from ..errors import NotFound
from ._capture_build import STUB
from ._containers import Containers
from ._copy import path_stat
from ._engine import Engine, docker_errors

__all__ = ("StubPaths",)

# Go's os.FileMode type bits (the engine's path stat): directory, symlink, device, pipe, socket, char device,
# irregular. A stub is a regular file.
_GO_TYPE_BITS = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
_ARCHIVE_MAX = 64 << 10  # a one-file tar of a stub: headers, the stub, padding and the end blocks
_KEPT_IMAGES = 1024  # image ids whose answer is kept (then forgotten all at once: asked again, same answer)


class StubPaths:
    """The paths of an image that hold the stub, asked once per image id."""

    def __init__(self, engine: Engine, containers: Containers) -> None:
        self._engine, self._containers = engine, containers
        # (image id, the paths asked) -> those holding the stub (an image's labels, so its paths, never change)
        self._known: dict[tuple[str, frozenset[str]], frozenset[str]] = {}

    async def holding(self, image_id: str, paths: list[str], action: str) -> frozenset[str]:
        """Those of `paths` where image `image_id` holds the daemon's stub."""
        key = (image_id, frozenset(paths))
        if (known := self._known.get(key)) is None:
            known = await self._read(image_id, sorted(key[1]), action)
            if len(self._known) >= _KEPT_IMAGES:
                self._known.clear()
            self._known[key] = known
        return known

    async def _read(self, image_id: str, paths: list[str], action: str) -> frozenset[str]:
        config: dict[str, Any] = {"Image": image_id, "Entrypoint": ["/coldsnap-provider-stub-check"], "Cmd": [],
                  "NetworkDisabled": True, "Labels": self._containers.ownership_labels()}
        with docker_errors(action, kind="image", ref=image_id):
            created = await self._engine.docker.containers.create(config)
        try:
            return frozenset([path for path in paths if await self._holds_stub(created.id, path, action)])
        finally:
            await self._containers.force_remove(created.id)

    async def _holds_stub(self, container_id: str, path: str, action: str) -> bool:
        try:
            with docker_errors(action, kind="path", ref=path):
                async with self._engine.stream(f"containers/{quote(container_id, safe='')}/archive",
                                               params={"path": path}) as response:
                    stat = path_stat(response.headers.get("X-Docker-Container-Path-Stat", ""))
                    if stat.get("size") != len(STUB) or int(stat.get("mode") or 0) & _GO_TYPE_BITS:
                        return False  # another file, a directory or a link: never read
                    body = b""
                    while len(body) <= _ARCHIVE_MAX and (data := await response.content.read(_ARCHIVE_MAX)):
                        body += data
        except NotFound:  # removed by a later layer
            return False
        try:
            with tarfile.open(fileobj=io.BytesIO(body[:_ARCHIVE_MAX]), mode="r:") as tar:
                member = tar.next()
                data_file = tar.extractfile(member) if member is not None and member.isfile() else None
                return data_file is not None and data_file.read(len(STUB) + 1) == STUB
        except tarfile.TarError:
            return False
