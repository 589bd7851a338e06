"""Which paths of a capsule's image still hold the daemon's stub, so that workload-run binds the capture's files
only there (``_captures.py``).

The files label says where the capture's files land, as the capture's build placed them. A later layer may have
put other bytes at such a path or removed it: a ``COPY`` after the capture's, or an image built ``FROM`` the
capsule (the labels are inherited). The image, run without the store, shows that layer's file; a read-only bind of
the capture's file would hide it (review of issue 34, finding 14). So a capture's file is bound only where the
image still holds that file's own stub byte for byte, and the container sees what the image holds everywhere else:
the store stays an optimisation, never a different image. Each stub names its capture and file (``_capture_build``),
so a stub a later layer moved or copied to another stub's path (or an older daemon's stub, which named neither) is
no stub of that path: the run is refused naming the path (review 2026-12-02, finding 9), since neither the image's
bytes (a stub) nor the capture's file would be what the image was built to hold there.

The image is read through a container created from it and never started (the engine's archive API; the path's
stat first, so a large file put there is never read), removed at once; it carries the RPC ownership labels, so a
daemon that dies meanwhile removes it at its next start. An image is immutable: its answer is kept by image id, and
is read when the daemon builds or pulls the image, so that its first run does not wait for it.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ..errors import NotFound
from ._capture_build import STUB_HEAD, stub
from ._containers import Containers
from ._copy import path_stat
from ._engine import Engine, docker_errors

__all__ = ("StubPaths", "Stubs")

# Go's os.FileMode type bits (the engine's path stat): directory, symlink, device, pipe, socket, char device,
# irregular. A stub is a regular file.
_GO_TYPE_BITS = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
_STUB_MAX = 8 << 10  # a stub: its head, a capture id and a path (PATH_MAX at most)
_ARCHIVE_MAX = 64 << 10  # a one-file tar of a stub: headers (a long name's pax header), the stub, padding, the end
_KEPT_IMAGES = 1024  # image ids whose answer is kept (then forgotten all at once: asked again, same answer)


@dataclass(frozen=True)
class Stubs:
    """What an image holds at the paths asked: its own stub (`held`), or the stub of another file or capture
    (`misplaced`, path -> what that stub says); any other path holds the image's own file."""

    held: frozenset[str]
    misplaced: tuple[tuple[str, str], ...]


class StubPaths:
    """The paths of an image that hold their stub, asked once per image id."""

    def __init__(self, engine: Engine, containers: Containers) -> None:
        self._engine, self._containers = engine, containers
        # (image id, the paths asked and their stubs) -> what the image holds there (an image never changes)
        self._known: dict[tuple[str, frozenset[tuple[str, bytes]]], Stubs] = {}

    async def holding(self, image_id: str, capture: str, files: dict[str, str], action: str) -> Stubs:
        """What image `image_id` holds at each path of `files` (image path -> file of `capture`: its stub's)."""
        expected = {target: stub(capture, source) for target, source in files.items()}
        key = (image_id, frozenset(expected.items()))
        if (known := self._known.get(key)) is None:
            known = await self._read(image_id, dict(sorted(expected.items())), action)
            if len(self._known) >= _KEPT_IMAGES:
                self._known.clear()
            self._known[key] = known
        return known

    async def _read(self, image_id: str, expected: dict[str, bytes], action: str) -> Stubs:
        config: dict[str, Any] = {"Image": image_id, "Entrypoint": ["/coldsnap-provider-stub-check"], "Cmd": [],
                  "NetworkDisabled": True, "Labels": self._containers.ownership_labels()}
        with docker_errors(action, kind="image", ref=image_id):
            created = await self._engine.docker.containers.create(config)
        held, misplaced = set(), []
        try:
            for path, wanted in expected.items():
                found = await self._stub_at(created.id, path, action)
                if found == wanted:
                    held.add(path)
                elif found is not None:
                    misplaced.append((path, found[len(STUB_HEAD):].decode("utf-8", "replace").strip()[:512]))
        finally:
            await self._containers.force_remove(created.id)
        return Stubs(held=frozenset(held), misplaced=tuple(misplaced))

    async def _stub_at(self, container_id: str, path: str, action: str) -> bytes | None:
        """The stub at `path` (any of this daemon's), or None: another file, a directory, a link, nothing."""
        try:
            with docker_errors(action, kind="path", ref=path):
                async with self._engine.stream(f"containers/{quote(container_id, safe='')}/archive",
                                               params={"path": path}) as response:
                    stat = path_stat(response.headers.get("X-Docker-Container-Path-Stat", ""))
                    size = stat.get("size")
                    if not isinstance(size, int) or not len(STUB_HEAD) <= size <= _STUB_MAX \
                            or int(stat.get("mode") or 0) & _GO_TYPE_BITS:
                        return None  # another file, a directory or a link: never read
                    body = b""
                    while len(body) <= _ARCHIVE_MAX and (data := await response.content.read(_ARCHIVE_MAX)):
                        body += data
        except NotFound:  # removed by a later layer
            return None
        try:
            with tarfile.open(fileobj=io.BytesIO(body[:_ARCHIVE_MAX]), mode="r:") as tar:
                member = tar.next()
                data_file = tar.extractfile(member) if member is not None and member.isfile() else None
                content = data_file.read(_STUB_MAX + 1) if data_file is not None else b""
        except tarfile.TarError:
            return None
        return content if content.startswith(STUB_HEAD) else None
